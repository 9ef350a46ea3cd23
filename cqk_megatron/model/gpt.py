"""Build this rank's Megatron ``GPTModel`` from a ``RunConfig``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig

from cqk_megatron.config import RunConfig
from cqk_megatron.model.norm import TorchNorm
from cqk_megatron.model.specs import layer_spec_from_config
from cqk_megatron.parallel.device import device

# fp64 is for numerical checks on CPU (layout equivalence far below fp32 rounding).
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


def transformer_config(config: RunConfig, device_type: str | None = None) -> TransformerConfig:
    """Megatron's ``TransformerConfig`` for our model, layout and precision, on this rank's
    device (``device_type``: the one to build it for instead, e.g. a GPU run's on CPU)."""
    m, p = config.model, config.parallel
    device_type = device_type or device().type
    on_gpu = device_type == "cuda"
    bf16 = config.train.precision == "bf16"
    dtype = PRECISIONS[config.train.precision]
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.kv_heads,
        kv_channels=m.head_dim,
        ffn_hidden_size=m.ffn_size,
        normalization=m.normalization,
        layernorm_epsilon=m.layernorm_epsilon,
        gated_linear_unit=m.swiglu,
        activation_func=F.silu if m.swiglu else F.gelu,
        add_bias_linear=m.add_bias_linear,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        tensor_model_parallel_size=p.tensor_parallel,
        pipeline_model_parallel_size=p.pipeline_parallel,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline,
        sequence_parallel=p.sequence_parallel,
        bf16=bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        # CPU: initialise full weights then slice, so every TP layout starts identical.
        use_cpu_initialization=not on_gpu,
        perform_initialization=True,
        deallocate_pipeline_outputs=False,
        **fusion_options(config, device_type),
        **p2p_options(p.pipeline_parallel, p.virtual_pipeline, device_type),
        **recompute_options(config),
    )


def fusion_options(config: RunConfig, device_type: str) -> dict:
    """Megatron-Core's fused kernels: on GPU, those that need neither Transformer Engine nor
    Apex (``megatron.core.fusions``, compiled by ``torch.compile``); on CPU none, where
    compiling them costs more than they save.

    - ``bias_activation_fusion``: SwiGLU as one function with a written-out backward
      (``bias_swiglu_impl``), the same math as the unfused ``silu(a) * b``. Megatron's gelu
      fusion uses the tanh approximation, a different function, so it stays off.
    - ``cross_entropy_loss_fusion`` (``native``): the vocabulary-parallel cross-entropy in
      three compiled pieces and one all-reduce instead of two. Its backward casts the
      logits' gradient to bf16, exact only where the logits are bf16, so bf16 runs only.
    - Off, for they need Apex's or Transformer Engine's kernels: ``masked_softmax_fusion``
      (our attention is SDPA or TE's own anyway), ``apply_rope_fusion``,
      ``gradient_accumulation_fusion``, ``persist_layer_norm``. ``bias_dropout_fusion``
      too: the shipped models have neither biases nor dropout, so it would fuse nothing.
    """
    on_gpu = device_type == "cuda"
    return {
        "bias_activation_fusion": on_gpu and config.model.swiglu,
        "cross_entropy_loss_fusion": on_gpu and config.train.precision == "bf16",
        "cross_entropy_fusion_impl": "native",
        "gradient_accumulation_fusion": False,
        "bias_dropout_fusion": False,
        "masked_softmax_fusion": False,
        "persist_layer_norm": False,
        "apply_rope_fusion": False,
    }


def p2p_options(pipeline_parallel: int, virtual_pipeline: int | None, device_type: str) -> dict:
    """How pipeline stages exchange activations and gradients: Megatron-Core's
    ``batch_p2p_comm`` / ``overlap_p2p_comm`` for this layout and device.

    At PP=2 the previous and the next stage are the same rank, and interleaved 1F1B sends
    to it in both directions in one exchange; point-to-point messages carry no tag (NCCL
    has none), so in one batched call a gradient can land in an activation's buffer of the
    same shape, silently. Megatron's unbatched path sends each direction through its own
    group, so it is safe with gloo and with NCCL.

    - GPU: Megatron-LM's own defaults (``core_transformer_config_from_args``:
      ``batch_p2p_comm = not overlap_p2p_comm``, overlap on only for the interleaved
      schedule, which alone supports it): interleaved overlaps unbatched sends with
      compute, plain 1F1B batches (a stage there never sends both ways at once).
    - CPU (gloo): unbatched and not overlapped, for both schedules: gloo matches a pair of
      ranks' messages in posting order, which a batched exchange at PP=2 also breaks.
    """
    if device_type != "cuda":
        return {"batch_p2p_comm": False, "overlap_p2p_comm": False}
    interleaved = pipeline_parallel > 1 and virtual_pipeline is not None
    return {"batch_p2p_comm": not interleaved, "overlap_p2p_comm": interleaved}


def recompute_options(config: RunConfig) -> dict:
    """``train.recompute`` as Megatron-Core's ``recompute_granularity`` / ``_method`` /
    ``_num_layers``: ``selective`` checkpoints the core attention (``core_attn``: scores,
    softmax and context are recomputed from q, k, v; a post-RoPE coupling, run in the core
    attention's pre-hook, with it), ``full`` whole layers from their inputs."""
    t = config.train
    if t.recompute == "none":
        return {}
    if t.recompute == "selective":
        return {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    per_chunk = config.model.num_layers // (
        config.parallel.pipeline_parallel * (config.parallel.virtual_pipeline or 1)
    )
    default = 1 if t.recompute_method == "uniform" else per_chunk
    return {
        "recompute_granularity": "full",
        "recompute_method": t.recompute_method,
        "recompute_num_layers": t.recompute_num_layers or default,
    }


def build_model(
    config: RunConfig,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    vp_stage: int | None = None,
) -> GPTModel:
    """The ``GPTModel`` for this rank's pipeline stage (parallel_state must be set up)."""
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(
            ignore_virtual=False, vp_stage=vp_stage
        )
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(
            ignore_virtual=False, vp_stage=vp_stage
        )
    megatron_config = transformer_config(config)
    model = GPTModel(
        config=megatron_config,
        transformer_layer_spec=block_spec(config, megatron_config, vp_stage),
        vocab_size=config.model.padded_vocab_size,
        max_sequence_length=config.model.seq_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=config.model.tie_embeddings,
        position_embedding_type=config.model.position_embedding_type,
        rotary_base=config.model.rotary_base,
        vp_stage=vp_stage,
    )
    # Megatron's torch norms are made in fp32 whatever params_dtype says; Megatron-LM's
    # Float16Module and DeepSpeed's bf16 mode both cast the whole model, and so do we, once,
    # here, so that both engines and the tools train and load the same tensors. A model
    # built on the meta device (the parameter counter) stays there.
    dtype = PRECISIONS[config.train.precision]
    if next(model.parameters()).is_meta:
        return model.to(dtype=dtype)
    return model.to(device=device(), dtype=dtype)


def block_spec(
    config: RunConfig, megatron_config: TransformerConfig, vp_stage: int | None
) -> TransformerBlockSubmodules:
    """This stage's layers and its final norm. Megatron builds the final norm from a
    module-level choice (Transformer Engine's, Apex's, else one that refuses sequence
    parallelism); with ``transformer_impl=local`` it is the layers' ``TorchNorm`` too."""
    layer = layer_spec_from_config(config)
    layers = get_num_layers_to_build(megatron_config, vp_stage=vp_stage)
    if config.transformer_impl != "local":
        from megatron.core.transformer.transformer_block import LayerNormImpl

        return TransformerBlockSubmodules(layer_specs=[layer] * layers, layer_norm=LayerNormImpl)
    return TransformerBlockSubmodules(layer_specs=[layer] * layers, layer_norm=TorchNorm)


class ModelChunks(torch.nn.ModuleList):
    """This rank's model chunks under interleaved 1F1B (``parallel.virtual_pipeline``).

    Chunk ``i`` holds the layers of virtual stage ``i``. Being one module, DeepSpeed and the
    parameter count see one set of parameters; the schedule gets the list of chunks and the
    checkpoint one sub-dict per chunk (``model0``, ``model1``, ... as in Megatron-LM).
    """


def build_rank_model(config: RunConfig) -> GPTModel | ModelChunks:
    """Everything this rank trains: one ``GPTModel``, or one chunk per virtual stage."""
    chunks = config.parallel.virtual_pipeline
    if chunks is None:
        return build_model(config)
    return ModelChunks(build_model(config, vp_stage=stage) for stage in range(chunks))


def model_chunks(model: torch.nn.Module) -> list[GPTModel]:
    return list(model) if isinstance(model, ModelChunks) else [model]


def sharded_state_dict(model: torch.nn.Module) -> dict:
    """The model's state for ``dist_checkpointing``. Tensors are keyed by their global
    names and layer numbers, so a checkpoint loads under any TP/PP/virtual layout."""
    if isinstance(model, ModelChunks):
        return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(model)}
    return model.sharded_state_dict()


def load_sharded_state(model: torch.nn.Module, state: dict) -> None:
    """Load what ``dist_checkpointing.load(sharded_state_dict(model))`` returned."""
    if isinstance(model, ModelChunks):
        for i, chunk in enumerate(model):
            chunk.load_state_dict(state[f"model{i}"])
    else:
        model.load_state_dict(state)


def count_parameters(model: torch.nn.Module) -> int:
    """``sum(p.numel())`` of a built model (this rank's part): what the tests and
    ``cqk params`` check the one count (``cqk_megatron.model.params``) against."""
    return sum(p.numel() for p in model.parameters())

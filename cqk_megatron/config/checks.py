"""``validate()``: rejects impossible configs and layouts before any process starts,
naming the field and the fix. Torch-free.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from cqk_megatron.config.schema import (
    MODEL_FAMILIES,
    POSITION_EMBEDDINGS,
    RECOMPUTE,
    RECOMPUTE_METHODS,
    AttentionConfig,
    ConfigError,
    DataConfig,
    LogConfig,
    ModelConfig,
    ResilienceSettings,
    RunConfig,
    TrainConfig,
)
from cqk_megatron.training.engines.megatron_spec import OPTIMIZER_CHECKPOINTS
from cqk_megatron.training.engines.registry import engine_names, engine_of
from cqk_megatron.variants import (
    COUPLING_IMPLS,
    COUPLING_POSITIONS,
    DIFFERENTIAL_KERNEL_SETTINGS,
    INTEGRATOR_STEPS,
    check_config,
    unknown_names,
)

# ---------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------
#
# ``validate`` runs small checks, one concern each, and reports every error together. The
# checks of single fields come first: the later ones divide by those fields and assume
# them valid. The checks that depend on the machine take its facts (``Hardware``) as an
# argument; ``validate`` passes those of this machine, read only when a check needs them.


class Hardware(typing.Protocol):
    """The facts about a machine that decide whether a config can run on it."""

    @property
    def cuda(self) -> bool: ...  # a CUDA device is usable

    @property
    def transformer_engine(self) -> bool: ...  # Transformer Engine is importable


@dataclass(frozen=True)
class StatedHardware:
    """Hardware facts stated, not read (tests; planning for another machine)."""

    cuda: bool = False
    transformer_engine: bool = False


class ThisMachine:
    """This machine's facts, each read on first use: a config that needs none of them is
    validated without importing torch."""

    @functools.cached_property
    def cuda(self) -> bool:
        return _cuda_available()

    @functools.cached_property
    def transformer_engine(self) -> bool:
        return _transformer_engine_importable()


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _transformer_engine_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


class _Checks:
    """Collects the message of every check that fails."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    def __call__(self, ok: bool, message: str) -> None:
        if not ok:
            self.errors.append(message)

    def choice(self, value: str, options: tuple[str, ...], dotted: str) -> None:
        self(value in options, f"{dotted}={value!r} is unknown; choose one of {list(options)}")


def _float_values(section: Any, prefix: str = "") -> Iterator[tuple[str, float]]:
    """``(dotted name, value)`` of every float in the config, lists' items included."""
    for item in dataclasses.fields(section):
        value = getattr(section, item.name)
        dotted = f"{prefix}{item.name}"
        if dataclasses.is_dataclass(value):
            yield from _float_values(value, f"{dotted}.")
        elif isinstance(value, float):
            yield dotted, value
        elif isinstance(value, list):
            yield from ((f"{dotted}[{i}]", v) for i, v in enumerate(value) if isinstance(v, float))


def _check_finite_numbers(config: RunConfig, check: _Checks) -> None:
    """No field holds inf or nan: both pass range checks such as ``lr > 0`` (inf) or
    compare false with everything (nan), and a run trained on them learns nothing."""
    for dotted, value in _float_values(config):
        check(
            math.isfinite(value),
            f"{dotted}={value} is not a finite number; give a finite value "
            "(an optional field takes null for none)",
        )


# A run's folder is log.root/name: a name is one path segment that every filesystem, shell
# and scheduler takes as it is.
_RUN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+=-]{0,199}")


def _check_run_name(name: str, check: _Checks) -> None:
    """``name`` cannot point outside ``log.root`` (``../x``, ``/x``, ``a/b``) or be empty."""
    check(
        _RUN_NAME.fullmatch(name) is not None,
        f"name={name!r} is not a run name: the run's folder is log.root/name, so a name is "
        "one path segment of letters, digits and . _ + = - (not starting with . + = or -), "
        "at most 200 characters, e.g. name=my-run; put the folder elsewhere with log.root",
    )


def _check_names(config: RunConfig, check: _Checks) -> None:
    """Every named choice is one of its options."""
    m, a, t = config.model, config.attention, config.train
    check.errors.extend(unknown_names(config))  # the registry's one message for each
    check.choice(a.position, COUPLING_POSITIONS, "attention.position")
    check.choice(a.coupling_impl, COUPLING_IMPLS, "attention.coupling_impl")
    check.choice(
        a.differential_kernel, DIFFERENTIAL_KERNEL_SETTINGS, "attention.differential_kernel"
    )
    check.choice(m.normalization, ("RMSNorm", "LayerNorm"), "model.normalization")
    check.choice(m.position_embedding_type, POSITION_EMBEDDINGS, "model.position_embedding_type")
    if m.family is not None:
        check.choice(m.family, tuple(MODEL_FAMILIES), "model.family")
    check.choice(t.precision, ("fp32", "bf16", "fp64"), "train.precision")
    check.choice(config.transformer_impl, ("local", "transformer_engine"), "transformer_impl")
    check.choice(t.schedule.decay, ("cosine", "wsd", "constant"), "train.schedule.decay")
    check.choice(t.engine, tuple(engine_names()), "train.engine")
    check.choice(t.optimizer_checkpoint, OPTIMIZER_CHECKPOINTS, "train.optimizer_checkpoint")
    check.choice(t.recompute, RECOMPUTE, "train.recompute")
    check.choice(t.recompute_method, RECOMPUTE_METHODS, "train.recompute_method")
    check.choice(config.log.wandb_mode, ("offline", "online", "disabled"), "log.wandb_mode")
    check.choice(config.log.progress_bar, ("auto", "on", "off"), "log.progress_bar")


def _check_architecture(m: ModelConfig, a: AttentionConfig, check: _Checks) -> None:
    """The architecture fields agree with the model family and the coupling's position."""
    family = MODEL_FAMILIES.get(m.family, {}) if m.family is not None else {}
    for key, value in family.items():  # none for family=null
        check(
            getattr(m, key) == value,
            f"model.{key}={getattr(m, key)!r} contradicts model.family={m.family!r}, which "
            f"has model.{key}={value!r}; drop the model.{key} override, or set "
            "model.family=null to describe a custom architecture by its fields",
        )
    check(
        not (a.position == "post_rope" and m.position_embedding_type != "rope"),
        f"attention.position=post_rope needs RoPE, but model.position_embedding_type="
        f"{m.position_embedding_type!r} has none (the coupling would run where pre_rope does); "
        "use attention.position=pre_rope",
    )


RESILIENCE = "train.resilience."  # where ResilienceSettings' keys are


def _check_training(t: TrainConfig, check: _Checks) -> None:
    """The optimizer, schedule, intervals and fault bounds, field by field."""
    check(t.zero_stage in (1, 2, 3), f"train.zero_stage={t.zero_stage} must be 1, 2 or 3")
    check(
        t.optimizer.lr > 0 and 0 <= t.schedule.min_lr <= t.optimizer.lr,
        "train.optimizer.lr must be positive and train.schedule.min_lr in [0, lr]",
    )
    check(t.schedule.warmup_steps >= 0, "train.schedule.warmup_steps must be >= 0")
    check(
        0 < t.schedule.wsd_decay_fraction <= 1,
        "train.schedule.wsd_decay_fraction must be in (0, 1]",
    )
    check(
        t.optimizer.clip_grad >= 0, "train.optimizer.clip_grad must be >= 0 (0 disables clipping)"
    )
    check(t.train_steps >= 1, "train.train_steps must be at least 1")
    check(t.checkpoint.keep_last >= 1, "train.checkpoint.keep_last must be at least 1")
    check_fault_bounds(t.resilience, check)
    for dotted, value in [
        ("train.eval_interval", t.eval_interval),
        ("train.checkpoint.save_interval", t.checkpoint.save_interval),
        ("train.log_interval", t.log_interval),
        (f"{RESILIENCE}max_nan_steps", t.resilience.max_nan_steps),
    ]:
        check(value >= 1, f"{dotted}={value} must be at least 1")
    interval = t.resilience.check_replicas_interval
    check(
        interval >= 0,
        f"{RESILIENCE}check_replicas_interval={interval} must be >= 0 (0 turns the replica "
        "check off)",
    )


def check_fault_bounds(r: ResilienceSettings, check: _Checks) -> None:
    """The watchdog's bounds must nest, or a collective times out (with torch's bare
    error) before the watchdog can name the rank that caused it."""
    names = (
        "init_timeout_s",
        "collective_timeout_s",
        "step_timeout_s",
        "save_timeout_s",
        "heartbeat_interval_s",
        "heartbeat_timeout_s",
    )
    values = {name: getattr(r, name) for name in names}
    bad = [n for n, v in values.items() if not isinstance(v, (int, float)) or not v > 0]
    for name in bad:
        check(False, f"{RESILIENCE}{name}={values[name]!r} must be a positive number of seconds")
    if bad:
        return
    check(
        r.heartbeat_interval_s < r.heartbeat_timeout_s,
        f"{RESILIENCE}heartbeat_interval_s={r.heartbeat_interval_s} must be below "
        f"{RESILIENCE}heartbeat_timeout_s={r.heartbeat_timeout_s} (a peer is declared lost "
        "after several missed heartbeats, not one)",
    )
    for shorter in ("heartbeat_timeout_s", "step_timeout_s"):
        check(
            values[shorter] < r.collective_timeout_s,
            f"{RESILIENCE}{shorter}={values[shorter]} must be below "
            f"{RESILIENCE}collective_timeout_s={r.collective_timeout_s}, so that the watchdog "
            "names a lost or stuck rank before its peers' collectives time out; raise "
            f"{RESILIENCE}collective_timeout_s or lower the other",
        )
    check(
        r.collective_timeout_s <= r.init_timeout_s,
        f"{RESILIENCE}collective_timeout_s={r.collective_timeout_s} must not exceed "
        f"{RESILIENCE}init_timeout_s={r.init_timeout_s} (start-up is the slow phase)",
    )


def _check_data(d: DataConfig, check: _Checks) -> None:
    """The blend's weights and the split string."""
    if d.weights is not None:
        check(
            len(d.weights) == len(d.prefixes),
            f"data.weights has {len(d.weights)} entries but data.prefixes has "
            f"{len(d.prefixes)}; give one weight per prefix (or none)",
        )
        check(all(w > 0 for w in d.weights), "data.weights must all be positive")
    check(
        d.num_workers == 0,
        f"data.num_workers={d.num_workers}: there are no data-loader workers to start; each "
        "rank reads its micro-batches itself (memory-mapped samples, microseconds each against "
        "a step of seconds), so set data.num_workers=0 or remove it",
    )
    split = d.split.split(",")
    check(
        len(split) == 3 and all(x.strip().replace(".", "", 1).isdigit() for x in split),
        f"data.split={d.split!r} must be three numbers 'train,valid,test', e.g. '969,30,1'",
    )


def _check_log(log: LogConfig, check: _Checks) -> None:
    check(
        log.peak_tflops is None or log.peak_tflops > 0,
        f"log.peak_tflops={log.peak_tflops} must be a positive number of TFLOP/s per device "
        "(or null: the GPU's from its name)",
    )


def _check_sizes(config: RunConfig, world_size: int | None, check: _Checks) -> None:
    """Every count the later checks divide by is at least 1."""
    m, p, t = config.model, config.parallel, config.train
    for dotted, value in [
        ("model.num_layers", m.num_layers),
        ("model.hidden_size", m.hidden_size),
        ("model.num_attention_heads", m.num_attention_heads),
        ("model.seq_length", m.seq_length),
        ("model.vocab_size", m.vocab_size),
        ("parallel.tensor_parallel", p.tensor_parallel),
        ("parallel.pipeline_parallel", p.pipeline_parallel),
        ("train.micro_batch_size", t.micro_batch_size),
        ("train.global_batch_size", t.global_batch_size),
        ("model.make_vocab_size_divisible_by", m.make_vocab_size_divisible_by),
        ("model.num_query_groups", 1 if m.num_query_groups is None else m.num_query_groups),
        ("model.ffn_hidden_size", m.ffn_size),
        ("parallel.world_size", p.world_size if p.world_size is not None else 1),
        ("world size", world_size if world_size is not None else 1),
    ]:
        check(value >= 1, f"{dotted}={value} must be at least 1")


def _check_model_shape(m: ModelConfig, tp: int, check: _Checks) -> None:
    """Heads divide the width, query groups the heads, and tensor parallelism both."""
    heads, kv_heads = m.num_attention_heads, m.kv_heads
    check(
        m.hidden_size % heads == 0,
        f"model.hidden_size={m.hidden_size} is not divisible by "
        f"model.num_attention_heads={heads}; pick a head count that divides it",
    )
    check(
        heads % kv_heads == 0,
        f"model.num_attention_heads={heads} is not a multiple of "
        f"model.num_query_groups={kv_heads}; use a divisor of the head count",
    )
    check(
        heads % tp == 0,
        f"model.num_attention_heads={heads} is not divisible by parallel.tensor_parallel={tp}; "
        "use a tensor-parallel size that divides the head count",
    )
    check(
        kv_heads % tp == 0,
        f"model.num_query_groups={kv_heads} is not divisible by parallel.tensor_parallel={tp}; "
        "each tensor-parallel rank needs whole key/value heads",
    )
    check(
        m.padded_vocab_size % tp == 0,
        f"padded vocabulary {m.padded_vocab_size} is not divisible by "
        f"parallel.tensor_parallel={tp}; raise model.make_vocab_size_divisible_by",
    )
    check(
        0 <= m.hidden_dropout < 1 and 0 <= m.attention_dropout < 1,
        "model.hidden_dropout and model.attention_dropout must be in [0, 1)",
    )


def _check_engine(config: RunConfig, check: _Checks) -> None:
    """What the chosen engine takes: its own rules (``training/engines/``)."""
    check.errors.extend(engine_of(config).config_errors(config))


def _layers_per_chunk(config: RunConfig) -> int:
    """The layers of each model chunk (per pipeline stage and virtual stage), 0 where the
    layout is refused."""
    p = config.parallel
    chunks = p.pipeline_parallel * (p.virtual_pipeline or 1)
    return config.model.num_layers // chunks if chunks else 0


def _check_parallel_layout(config: RunConfig, check: _Checks) -> None:
    """Pipeline, virtual pipeline and sequence parallelism against the model and the
    layers' implementation."""
    m, p = config.model, config.parallel
    tp, pp = p.tensor_parallel, p.pipeline_parallel
    if p.sequence_parallel:
        check(
            m.seq_length % tp == 0,
            f"model.seq_length={m.seq_length} is not divisible by parallel.tensor_parallel={tp}, "
            "which sequence parallelism needs; change one of them",
        )
    chunks = pp * (p.virtual_pipeline or 1)
    check(
        m.num_layers % chunks == 0,
        f"model.num_layers={m.num_layers} is not divisible by parallel.pipeline_parallel={pp}"
        + (f" x parallel.virtual_pipeline={p.virtual_pipeline}" if p.virtual_pipeline else "")
        + "; change the layer count or the pipeline size",
    )
    if p.virtual_pipeline is not None:
        check(
            pp > 1 and p.virtual_pipeline >= 1,
            "parallel.virtual_pipeline needs parallel.pipeline_parallel > 1 and a value >= 1",
        )
    check(
        not p.sequence_parallel or tp > 1,
        "parallel.sequence_parallel=true needs parallel.tensor_parallel > 1",
    )


def _check_recompute(t: TrainConfig, layers_per_chunk: int, check: _Checks) -> None:
    """``train.recompute*`` against the layers each model chunk holds (Megatron-Core's
    ``recompute_num_layers`` counts per chunk: per pipeline stage and virtual stage)."""
    n = t.recompute_num_layers
    if t.recompute != "full":
        check(
            n is None,
            f"train.recompute_num_layers={n} applies to train.recompute=full only; remove it "
            f"(train.recompute={t.recompute!r})",
        )
        return
    if n is None or layers_per_chunk < 1:
        return
    check(n >= 1, f"train.recompute_num_layers={n} must be at least 1")
    if t.recompute_method == "uniform":
        check(
            n >= 1 and layers_per_chunk % n == 0,
            f"train.recompute_num_layers={n} with train.recompute_method=uniform must divide "
            f"the {layers_per_chunk} layers of each model chunk (model.num_layers over "
            "pipeline and virtual stages); pick a divisor",
        )
    else:
        check(
            n <= layers_per_chunk,
            f"train.recompute_num_layers={n} with train.recompute_method=block is more than "
            f"the {layers_per_chunk} layers of each model chunk; use at most {layers_per_chunk}",
        )


def _check_attention_options(config: RunConfig, check: _Checks) -> None:
    """The chosen coupling's and scoring's own rules, then the integrator's options."""
    m, a = config.model, config.attention
    check.errors.extend(check_config(config))  # the registry's rules for the chosen pair
    low, high = INTEGRATOR_STEPS
    check(
        low <= a.steps <= high,
        f"attention.steps={a.steps} is out of range; the integrators take {low} to {high} steps",
    )
    check(a.dt_init > 0, f"attention.dt_init={a.dt_init} must be positive")
    hidden = a.coupling_hidden if a.coupling_hidden is not None else m.head_dim
    check(hidden >= 1, f"attention.coupling_hidden={hidden} is too small")
    check(a.invertible_layers >= 1, "attention.invertible_layers must be at least 1")
    check(a.invertible_scale_bound > 0, "attention.invertible_scale_bound must be positive")


def _check_world(config: RunConfig, world_size: int | None, check: _Checks) -> None:
    """With a world size (given, or ``parallel.world_size``): the data-parallel split."""
    p, t = config.parallel, config.train
    tp, pp = p.tensor_parallel, p.pipeline_parallel
    world = world_size if world_size is not None else p.world_size
    if world is None:
        return
    check(
        world % (tp * pp) == 0,
        f"world size {world} is not divisible by parallel.tensor_parallel={tp} x "
        f"parallel.pipeline_parallel={pp}; ask for a multiple of {tp * pp} processes",
    )
    if world % (tp * pp) == 0:
        dp = world // (tp * pp)
        check(
            t.global_batch_size % (t.micro_batch_size * dp) == 0,
            f"train.global_batch_size={t.global_batch_size} is not divisible by "
            f"train.micro_batch_size={t.micro_batch_size} x data parallel {dp}; "
            f"use a multiple of {t.micro_batch_size * dp}",
        )


def hardware_errors(config: RunConfig, hardware: Hardware) -> list[str]:
    """What refuses ``config`` on a machine with these facts (a valid config otherwise)."""
    check = _Checks()
    if config.train.engine in engine_names():
        check.errors.extend(engine_of(config).hardware_errors(config, hardware))
    if config.transformer_impl == "transformer_engine":
        check(
            hardware.transformer_engine,
            "transformer_impl=transformer_engine but Transformer Engine is not importable "
            "here; set transformer_impl=local (every layout runs with it, sequence "
            "parallelism included) or install transformer-engine[pytorch] built for this "
            "torch and CUDA",
        )
    return check.errors


def config_errors(
    config: RunConfig, world_size: int | None = None, hardware: Hardware | None = None
) -> list[str]:
    """Every reason ``config`` cannot run on ``world_size`` ranks of a machine with
    ``hardware``'s facts (default: this one's); empty if it can. Where a single field is
    wrong, only those errors: the checks of combinations assume valid fields."""
    check = _Checks()
    _check_finite_numbers(config, check)
    if check.errors:
        return check.errors  # every other check compares numbers
    _check_run_name(config.name, check)
    _check_names(config, check)
    _check_architecture(config.model, config.attention, check)
    _check_training(config.train, check)
    _check_data(config.data, check)
    _check_log(config.log, check)
    _check_sizes(config, world_size, check)
    if check.errors:
        return check.errors
    _check_model_shape(config.model, config.parallel.tensor_parallel, check)
    _check_engine(config, check)
    _check_parallel_layout(config, check)
    _check_recompute(config.train, _layers_per_chunk(config), check)
    _check_attention_options(config, check)
    check.errors.extend(hardware_errors(config, hardware or ThisMachine()))
    _check_world(config, world_size, check)
    return check.errors


def validate(config: RunConfig, world_size: int | None = None) -> RunConfig:
    """Refuse configs that cannot work; every message names the field and the fix.

    ``world_size`` (or ``parallel.world_size``) enables the data-parallel checks.
    """
    errors = config_errors(config, world_size)
    if errors:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors))
    return config

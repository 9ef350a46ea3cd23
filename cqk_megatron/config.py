"""Typed run configuration: dataclasses are the one source of truth.

YAML files under ``configs/`` are serialised instances. A file may start with
``include: [other.yaml, ...]`` (paths relative to the file, then to ``configs/``); later
entries and the file's own keys win. ``key.sub=value`` overrides apply last, values
parsed as YAML. ``validate()`` rejects impossible layouts before any process starts,
naming the field and the fix.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
import re
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cqk_megatron.refusals import Refusal

# The couplings, scorings and named variants (presets of the two) are the registry's, as
# live views: a coupling registered later (README, "Adding a variant") is in them too. The
# registry is torch-free, like this module.
from cqk_megatron.variants import (
    COUPLING_IMPLS,
    COUPLING_POSITIONS,
    COUPLINGS,  # noqa: F401  (re-exported)
    DIFFERENTIAL_KERNEL_SETTINGS,
    INTEGRATOR_STEPS,
    SCORINGS,  # noqa: F401
    VARIANTS,
    check_config,
    unknown_names,
    variant_name,
)

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"

# Model families are presets of the model's architecture fields, as variants are of the
# attention's: Llama-style (the default fields) and GPT-2-style.
MODEL_FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {
        "normalization": "RMSNorm",
        "swiglu": True,
        "position_embedding_type": "rope",
        "add_bias_linear": False,
    },
    "gpt2": {
        "normalization": "LayerNorm",
        "swiglu": False,  # a GELU MLP of width 4 x hidden
        "position_embedding_type": "learned_absolute",
        "add_bias_linear": True,  # biases in QKV, attention output, fc1 and fc2, as GPT-2
    },
}
POSITION_EMBEDDINGS = ("rope", "learned_absolute")


def family_overrides(family: str) -> list[str]:
    """``key=value`` overrides that turn any model config into ``family``'s architecture
    (its fields set explicitly, so they win over a file that names the other family's;
    the MLP width goes back to the family's default: 8/3 x hidden for SwiGLU, 4 x for GELU)."""
    if family not in MODEL_FAMILIES:
        raise ConfigError(
            f"model family {family!r} is unknown; choose one of {list(MODEL_FAMILIES)}"
        )
    fields = [
        f"model.{key}={str(value).lower() if isinstance(value, bool) else value}"
        for key, value in MODEL_FAMILIES[family].items()
    ]
    return [f"model.family={family}", *fields, "model.ffn_hidden_size=null"]


# train.recompute (Megatron-Core's recompute_granularity) and, for full, its method; the
# planner (perf/memory.py, perf/plan.py) offers exactly these.
RECOMPUTE = ("none", "selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")


class ConfigError(Refusal, ValueError):
    """A configuration that cannot work; the message names the field(s) and the fix."""


@dataclass
class ModelConfig:
    """Transformer shape (Llama-style by default: RMSNorm, SwiGLU, RoPE, no biases).

    ``family`` (``llama`` | ``gpt2``, see ``MODEL_FAMILIES``) fills in the architecture
    fields it names wherever the config does not set them; ``validate`` refuses a field
    that contradicts the family. ``None``: the fields alone decide.
    """

    num_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: int | None = None  # None: one key/value head per query head
    ffn_hidden_size: int | None = None  # None: SwiGLU's 8/3 * hidden, rounded up to 64
    seq_length: int = 128
    vocab_size: int = 32000
    make_vocab_size_divisible_by: int = 128  # padded once, independently of TP
    normalization: str = "RMSNorm"
    swiglu: bool = True
    rotary_base: int = 10000
    tie_embeddings: bool = False
    init_method_std: float = 0.02
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    layernorm_epsilon: float = 1e-5
    position_embedding_type: str = "rope"  # rope | learned_absolute (model.seq_length rows)
    add_bias_linear: bool = False  # biases in every linear layer but the output layer
    family: str | None = None  # llama | gpt2: presets of the four fields above and swiglu

    @property
    def architecture_family(self) -> str:
        """The family these fields describe (``llama``, ``gpt2``), or ``custom``."""
        for name, fields in MODEL_FAMILIES.items():
            if all(getattr(self, key) == value for key, value in fields.items()):
                return name
        return "custom"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_heads(self) -> int:
        if self.num_query_groups is None:
            return self.num_attention_heads
        return self.num_query_groups

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if not self.swiglu:
            return 4 * self.hidden_size
        return 64 * math.ceil(8 * self.hidden_size / 3 / 64)

    @property
    def padded_vocab_size(self) -> int:
        multiple = self.make_vocab_size_divisible_by
        return multiple * math.ceil(self.vocab_size / multiple)


@dataclass
class AttentionConfig:
    """The two orthogonal choices of a layer's attention and their options."""

    coupling: str = "none"  # a registered coupling (COUPLINGS): none, hamiltonian, ...
    scoring: str = "standard"  # a registered scoring (SCORINGS): standard, differential
    steps: int = 1  # integrator steps, in INTEGRATOR_STEPS (1..7)
    coupling_hidden: int | None = None  # hidden width of f; None: head_dim
    dt_init: float = 0.1
    position: str = "pre_rope"  # pre_rope | post_rope
    invertible_layers: int = 2
    invertible_scale_bound: float = 2.0
    # how the coupling runs: eager (the fused form of attention/fast_coupling.py, run
    # eagerly; the parameters are coupling.py's) | compiled (the same under torch.compile,
    # the natural choice on GPU); both compute coupling.py's function
    coupling_impl: str = "eager"
    recompute_coupling: bool = False  # recompute the coupling in backward, store only q, k
    # differential scoring: paired (2 attention calls, values 2 head_dim wide) | split (4
    # calls, for kernels needing values as wide as queries) | auto (from backend and device)
    differential_kernel: str = "auto"

    @property
    def variant(self) -> str:
        """The preset name of this (coupling, scoring) pair, or ``coupling+scoring``."""
        return variant_name(self.coupling, self.scoring)


@dataclass
class ParallelConfig:
    """Model-parallel layout; data parallel is what remains of the world size."""

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    virtual_pipeline: int | None = None  # interleaved 1F1B chunks per pipeline rank
    sequence_parallel: bool = False
    world_size: int | None = None  # None: taken from the launcher at run time

    def data_parallel(self, world_size: int) -> int:
        return world_size // (self.tensor_parallel * self.pipeline_parallel)


@dataclass
class TrainConfig:
    """The training loop: batches, optimiser, schedule, engine, evaluation, checkpoints."""

    micro_batch_size: int = 2
    global_batch_size: int = 8
    precision: str = "fp32"  # fp32 | bf16 | fp64 (numerical checks on CPU)
    train_steps: int = 100
    # AdamW
    lr: float = 3e-4
    min_lr: float = 3e-5
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # 0 disables clipping
    # learning-rate schedule: warmup then cosine | wsd (warmup-stable-decay) | constant
    lr_schedule: str = "cosine"
    warmup_steps: int = 10
    wsd_decay_fraction: float = 0.2  # wsd: the last fraction of steps decays linearly
    # data-parallel engine: deepspeed (ZeRO) | megatron (Megatron-Core DDP + distributed
    # optimizer, CPU and GPU)
    engine: str = "deepspeed"
    zero_stage: int = 1
    offload_optimizer: bool = False
    # reduce the data-parallel gradients bucket by bucket during the backward: Megatron's
    # DDP overlap_grad_reduce (train.engine=megatron) or DeepSpeed ZeRO's overlap_comm
    # (false leaves DeepSpeed's default: on for ZeRO-3 only); the cluster configs turn it on
    overlap_grad_reduce: bool = False
    # train.engine=megatron: the distributed optimizer's checkpoint format. dp_reshardable:
    # each rank writes its own shard; a resume under another data-parallel size keeps the
    # optimizer state. fully_reshardable: saved per parameter after a gather on one rank per
    # model-parallel group (slower saves), so a resume under another TP or PP size keeps it
    # too (docs/checkpoints.md). Either format loads whatever this says.
    optimizer_checkpoint: str = "dp_reshardable"
    # activation recompute: none | selective (the core attention: scores, softmax and
    # context recomputed from q, k, v in the backward) | full (whole layers from their
    # inputs). full: recompute_method uniform (units of recompute_num_layers layers, default
    # 1) | block (the first recompute_num_layers layers of each model chunk, default all)
    recompute: str = "none"
    recompute_method: str = "uniform"
    recompute_num_layers: int | None = None
    # evaluation and checkpoints (in optimizer steps)
    eval_interval: int = 50
    eval_iters: int = 4  # global batches of the validation split per evaluation
    save_interval: int = 100
    keep_last: int = 3
    checkpoint_hashes: bool = True  # each file's xxh3-128 in the manifest (else sizes only)
    # a save stages the state in host memory and training goes on while a background
    # thread writes it; committed (manifest, rename, latest) only once every rank's write
    # has finished (docs/checkpoints.md). null (the default): on on GPU, off on CPU
    async_save: bool | None = None
    # robustness
    max_nan_steps: int = 5  # abort after this many skipped (non-finite) steps in a row
    wall_clock_budget_s: float | None = None  # checkpoint and exit for requeue after this
    exit_after_steps: int | None = None  # checkpoint and exit for requeue at this step
    init_from: str | None = None  # weights-only checkpoint to start from (any layout)
    log_interval: int = 1
    # every this many steps, and at the end, check that every parameter that must be the
    # same on several ranks is, bit for bit (data-parallel replicas, parameters whole on
    # every tensor-parallel rank, tied embedding copies across pipeline stages); the run
    # stops naming the first that differs and the ranks (training/replicas.py). 0: off
    check_replicas_interval: int = 0
    # faults (training/watchdog.py): no rank waits forever. Rendezvous, process-group
    # creation, start-up and the first step are bounded by init_timeout_s; after the first
    # step every process group's collectives time out after collective_timeout_s (raised
    # to save_timeout_s + heartbeat_timeout_s during a checkpoint save). Each rank's
    # watchdog heartbeats through the job's TCPStore every heartbeat_interval_s; a rank
    # silent for heartbeat_timeout_s, or one whose main thread stays longer than its bound
    # in a phase (a step or a data fetch: step_timeout_s; a save: save_timeout_s), ends
    # the job with exit 76 and a line naming it. Anchors: torchtitan 300 s / 100 s,
    # torchft heartbeats every 5 s, nvidia-resiliency-ext 60 s / 90 s soft / hard.
    init_timeout_s: float = 300.0
    collective_timeout_s: float = 100.0
    step_timeout_s: float = 60.0
    save_timeout_s: float = 600.0
    heartbeat_interval_s: float = 5.0
    heartbeat_timeout_s: float = 30.0


# train.optimizer_checkpoint: Megatron's DistributedOptimizer sharding types (the default first)
OPTIMIZER_CHECKPOINTS = ("dp_reshardable", "fully_reshardable")


@dataclass
class LogConfig:
    """Where a run writes: ``root/name`` holds config, metrics, checkpoints, logs."""

    root: str = "runs"
    wandb_mode: str = "offline"  # offline | online | disabled (online needs WANDB_API_KEY)
    wandb_project: str = "cqk-megatron"
    tags: list[str] = field(default_factory=list)
    tensorboard: bool = False
    progress_bar: str = "auto"  # auto (only on a terminal) | on | off


@dataclass
class DataConfig:
    """Indexed ``.bin/.idx`` datasets read through Megatron's ``BlendedMegatronDatasetBuilder``.

    ``prefixes`` are dataset path prefixes (without ``.bin``/``.idx``); ``weights`` blend
    them (None: proportional to size). ``split`` is Megatron's train/valid/test split
    string. ``mock: true`` uses Megatron's mock GPT dataset (tests, smoke runs).
    """

    prefixes: list[str] = field(default_factory=list)
    weights: list[float] | None = None
    split: str = "969,30,1"
    tokenizer: str | None = None  # SentencePiece .model (or a Hugging Face tokenizer folder)
    mock: bool = False
    # 0 only: each rank reads its batches itself (sampler.fetch: a memory-mapped slice per
    # sample, microseconds against a step); there are no DataLoader workers to ask for
    num_workers: int = 0
    cache_dir: str | None = None  # Megatron's index cache; None: the run folder's index_cache/
    # the dataset's shuffling seed; None: the run's seed. Fix it to compare model seeds on
    # the same data order and the same validation windows.
    seed: int | None = None


@dataclass
class RunConfig:
    name: str = "run"
    seed: int = 1234
    backend: str = "local"  # local | transformer_engine (GPU, where installed)
    model: ModelConfig = field(default_factory=ModelConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    log: LogConfig = field(default_factory=LogConfig)


# ---------------------------------------------------------------------------------------
# dict <-> dataclass
# ---------------------------------------------------------------------------------------


def _unknown_key_error(key: str, where: str, cls: type, source: str) -> ConfigError:
    names = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(key, names, n=1)
    hint = f"did you mean '{where}{close[0]}'?" if close else f"known keys: {', '.join(names)}"
    return ConfigError(f"{source}: unknown key '{where}{key}'; {hint}")


def _coerce(value: Any, annotation: Any, dotted: str, source: str) -> Any:
    """Check ``value`` against a field's annotation (int, float, bool, str, optional,
    ``list[X]``, ``dict[str, X]``, a dataclass, ``A | B``: the first that takes it)."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        return _coerce_union([a for a in args if a is not type(None)], value, dotted, source)
    if annotation is Any:
        return value
    if dataclasses.is_dataclass(annotation):
        return from_dict(annotation, {} if value is None else value, source, f"{dotted}.")
    if typing.get_origin(annotation) is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: '{dotted}' must be a mapping, got {value!r}")
        _, item = typing.get_args(annotation)
        return {str(k): _coerce(v, item, f"{dotted}.{k}", source) for k, v in value.items()}
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation is float and isinstance(value, str):
        try:  # YAML 1.1 reads "1e-3" (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation)
        if not isinstance(value, list):
            raise ConfigError(f"{source}: '{dotted}' must be a list, got {value!r}")
        return [_coerce(v, item, f"{dotted}[{i}]", source) for i, v in enumerate(value)]
    if annotation in (int, float, bool, str):
        ok = isinstance(value, annotation) and not (annotation is int and isinstance(value, bool))
        if not ok:
            raise ConfigError(f"{source}: '{dotted}' must be {annotation.__name__}, got {value!r}")
    return value


def _coerce_union(options: list, value: Any, dotted: str, source: str) -> Any:
    errors = []
    for option in options:
        try:
            return _coerce(value, option, dotted, source)
        except ConfigError as error:
            errors.append(error)
    raise (
        errors[-1]
        if len(errors) == 1
        else ConfigError(
            f"{source}: '{dotted}' must be one of {' or '.join(_type_name(o) for o in options)}, "
            f"got {value!r}"
        )
    )


def _type_name(annotation: Any) -> str:
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


def from_dict(cls: type, data: dict, source: str = "config", prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a nested dict, refusing unknown keys, bad types and
    missing required keys: the one typed reader of runs, sweeps and cluster profiles."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: '{prefix.rstrip('.') or 'top level'}' must be a mapping")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise _unknown_key_error(key, prefix, cls, source)
        kwargs[key] = _coerce(value, hints[key], prefix + key, source)
    for name, spec in fields.items():
        required = (
            spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING
        )
        if required and name not in kwargs:
            raise ConfigError(f"{source}: '{prefix}{name}' is required")
    return cls(**kwargs)


def to_dict(config: Any) -> dict:
    return dataclasses.asdict(config)


# ---------------------------------------------------------------------------------------
# YAML files, includes and overrides
# ---------------------------------------------------------------------------------------


def _deep_merge(base: dict, update: dict) -> dict:
    merged = copy.deepcopy(base)
    for key, value in update.items():
        if value is None and isinstance(merged.get(key), dict):
            continue  # "model:" with everything commented out keeps what was included
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def variant_preset(path: str | Path) -> dict | None:
    """``variants/<preset>.yaml`` (any folder named ``variants``, the file absent) as the
    registry's preset: its ``attention.coupling`` and ``attention.scoring``. The presets
    live in the registry only (``variants/builtin.py``, or registered from code), so that
    no YAML copy of them can drift; a real file of that name wins."""
    path = Path(path)
    if path.parent.name != "variants" or path.suffix != ".yaml" or path.is_file():
        return None
    if path.stem not in VARIANTS:
        return None
    coupling, scoring = VARIANTS[path.stem]
    return {"attention": {"coupling": coupling, "scoring": scoring}}


def _resolve_include(name: str, relative_to: Path) -> Path:
    for candidate in (relative_to / name, CONFIGS_DIR / name):
        if candidate.is_file() or variant_preset(candidate) is not None:
            return candidate
    raise ConfigError(
        f"{relative_to}: included file '{name}' not found next to it or under {CONFIGS_DIR}"
        f" (variants/NAME.yaml names a registered preset: one of {list(VARIANTS)})"
    )


def read_yaml(path: str | Path, what: str = "config file", fix: str = "") -> dict:
    """The top-level mapping of one YAML file: the one reader of run configs, sweeps and
    cluster profiles, with one error format (the file, what is wrong, the fix); the
    caller types the mapping with ``from_dict``, whose errors name the key."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} '{path}' does not exist" + (f" ({fix})" if fix else ""))
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from error
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of keys")
    return data


def load_yaml_dict(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict:
    """Read a config file with its includes resolved into one nested dict."""
    path = Path(path)
    preset = variant_preset(path)
    if preset is not None:
        return preset
    if path.resolve() in _seen:
        raise ConfigError(f"{path}: include cycle through {[str(p) for p in _seen]}")
    data = read_yaml(path)
    includes = data.pop("include", []) or []
    if isinstance(includes, str):
        includes = [includes]
    merged: dict = {}
    for name in includes:
        included = _resolve_include(name, path.parent)
        merged = _deep_merge(merged, load_yaml_dict(included, _seen + (path.resolve(),)))
    return _deep_merge(merged, data)


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``a.b=c`` overrides (``c`` parsed as YAML) to a nested dict."""
    data = _deep_merge({}, data)
    for override in overrides:
        if "=" not in override:
            raise ConfigError(f"override '{override}' must look like section.key=value")
        dotted, raw = override.split("=", 1)
        keys = dotted.strip().split(".")
        node = data
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{override}': '{key}' is not a section")
        node[keys[-1]] = _override_value(override, raw)
    return data


def _override_value(override: str, raw: str) -> Any:
    """The value of ``key=raw`` as YAML reads it (empty: null)."""
    if not raw.strip():
        return None
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError as error:
        problem = str(error).splitlines()[0]
        raise ConfigError(
            f"override {override!r}: the value is not valid YAML ({problem}); quote it, "
            "e.g. key='value'"
        ) from error


def apply_model_family(data: dict) -> dict:
    """Fill in the architecture fields of ``model.family`` that ``data`` leaves unset."""
    model = data.get("model")
    family = model.get("family") if isinstance(model, dict) else None
    if family not in MODEL_FAMILIES:
        return data  # None, or unknown: validate() names it
    return _deep_merge(data, {"model": {**MODEL_FAMILIES[family], **model}})


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load a YAML config (or the defaults) and apply overrides; does not validate."""
    data = load_yaml_dict(path) if path is not None else {}
    data = apply_model_family(apply_overrides(data, overrides or []))
    source = str(path) if path is not None else "defaults"
    if overrides:
        source += " + overrides"
    return from_dict(RunConfig, data, source)


def save_config(config: RunConfig, path: str | Path) -> None:
    """Write the resolved config; ``load_config`` of the file gives it back."""
    Path(path).write_text(yaml.safe_dump(to_dict(config), sort_keys=False))


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
    check.choice(config.backend, ("local", "transformer_engine"), "backend")
    check.choice(t.lr_schedule, ("cosine", "wsd", "constant"), "train.lr_schedule")
    check.choice(t.engine, ("deepspeed", "megatron"), "train.engine")
    check.choice(t.optimizer_checkpoint, OPTIMIZER_CHECKPOINTS, "train.optimizer_checkpoint")
    check.choice(t.recompute, RECOMPUTE, "train.recompute")
    check.choice(t.recompute_method, RECOMPUTE_METHODS, "train.recompute_method")
    check.choice(config.log.wandb_mode, ("offline", "online", "disabled"), "log.wandb_mode")
    check.choice(config.log.progress_bar, ("auto", "on", "off"), "log.progress_bar")


def _check_architecture(m: ModelConfig, a: AttentionConfig, check: _Checks) -> None:
    """The architecture fields agree with the model family and the coupling's position."""
    for key, value in MODEL_FAMILIES.get(m.family, {}).items():  # none for family=null
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


def _check_training(t: TrainConfig, check: _Checks) -> None:
    """The optimizer, schedule, intervals and fault bounds, field by field."""
    check(t.zero_stage in (1, 2, 3), f"train.zero_stage={t.zero_stage} must be 1, 2 or 3")
    check(
        t.lr > 0 and 0 <= t.min_lr <= t.lr, "train.lr must be positive and train.min_lr in [0, lr]"
    )
    check(t.warmup_steps >= 0, "train.warmup_steps must be >= 0")
    check(0 < t.wsd_decay_fraction <= 1, "train.wsd_decay_fraction must be in (0, 1]")
    check(t.clip_grad >= 0, "train.clip_grad must be >= 0 (0 disables clipping)")
    check(t.train_steps >= 1, "train.train_steps must be at least 1")
    check(t.keep_last >= 1, "train.keep_last must be at least 1")
    check_fault_bounds(t, check)
    for dotted, value in [
        ("train.eval_interval", t.eval_interval),
        ("train.save_interval", t.save_interval),
        ("train.log_interval", t.log_interval),
        ("train.max_nan_steps", t.max_nan_steps),
    ]:
        check(value >= 1, f"{dotted}={value} must be at least 1")
    check(
        t.check_replicas_interval >= 0,
        f"train.check_replicas_interval={t.check_replicas_interval} must be >= 0 (0 turns the "
        "replica check off)",
    )


def check_fault_bounds(t: TrainConfig, check) -> None:
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
    values = {name: getattr(t, name) for name in names}
    bad = [n for n, v in values.items() if not isinstance(v, (int, float)) or not v > 0]
    for name in bad:
        check(False, f"train.{name}={values[name]!r} must be a positive number of seconds")
    if bad:
        return
    check(
        t.heartbeat_interval_s < t.heartbeat_timeout_s,
        f"train.heartbeat_interval_s={t.heartbeat_interval_s} must be below "
        f"train.heartbeat_timeout_s={t.heartbeat_timeout_s} (a peer is declared lost after "
        "several missed heartbeats, not one)",
    )
    for shorter in ("heartbeat_timeout_s", "step_timeout_s"):
        check(
            values[shorter] < t.collective_timeout_s,
            f"train.{shorter}={values[shorter]} must be below "
            f"train.collective_timeout_s={t.collective_timeout_s}, so that the watchdog names "
            "a lost or stuck rank before its peers' collectives time out; raise "
            "train.collective_timeout_s or lower the other",
        )
    check(
        t.collective_timeout_s <= t.init_timeout_s,
        f"train.collective_timeout_s={t.collective_timeout_s} must not exceed "
        f"train.init_timeout_s={t.init_timeout_s} (start-up is the slow phase)",
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


def _check_engine(t: TrainConfig, pp: int, check: _Checks) -> None:
    """What each data-parallel engine takes."""
    if pp > 1 and t.engine == "deepspeed":
        check(
            t.zero_stage == 1,
            f"train.zero_stage={t.zero_stage} with parallel.pipeline_parallel={pp}: ZeRO-2/3 "
            "reduce gradients inside each backward, which Megatron's pipeline schedule drives "
            "itself; use train.zero_stage=1 with pipeline parallelism",
        )
    if t.engine == "megatron":
        check(
            t.precision in ("fp32", "bf16"),
            f"train.precision={t.precision!r} with train.engine=megatron: Megatron's distributed "
            "optimizer takes fp32 or bf16 parameters; use train.precision=fp32 or bf16 (or "
            "train.engine=deepspeed for fp64 checks)",
        )
        check(
            not t.offload_optimizer,
            "train.offload_optimizer=true is DeepSpeed's optimizer offload; with "
            "train.engine=megatron set it to false, or use train.engine=deepspeed",
        )
    check(
        not (t.overlap_grad_reduce and t.engine == "deepspeed" and pp > 1),
        f"train.overlap_grad_reduce=true with train.engine=deepspeed and "
        f"parallel.pipeline_parallel={pp}: DeepSpeed's overlap_comm reduces gradients in "
        "hooks inside each backward, which Megatron's pipeline schedule drives itself "
        "(DeepSpeed's own pipeline engine turns it off); set train.overlap_grad_reduce=false, "
        "or use train.engine=megatron",
    )
    check(
        not (
            t.overlap_grad_reduce
            and t.engine == "deepspeed"
            and t.precision == "bf16"
            and t.zero_stage == 1
            and not t.offload_optimizer
        ),
        "train.overlap_grad_reduce=true with train.engine=deepspeed, train.zero_stage=1 and "
        "train.precision=bf16 would do nothing: with fp32 gradient sums DeepSpeed runs "
        "ZeRO-1 in bf16 as its BF16_Optimizer, which reduces after the backward; use "
        "train.zero_stage=2 (gradients reduce-scattered during the backward), or "
        "train.engine=megatron, or set train.overlap_grad_reduce=false",
    )
    check(
        t.optimizer_checkpoint == OPTIMIZER_CHECKPOINTS[0] or t.engine == "megatron",
        f"train.optimizer_checkpoint={t.optimizer_checkpoint} applies to train.engine=megatron "
        f"only (DeepSpeed saves ZeRO's own format); set it to {OPTIMIZER_CHECKPOINTS[0]}",
    )


def _layers_per_chunk(config: RunConfig) -> int:
    """The layers of each model chunk (per pipeline stage and virtual stage), 0 where the
    layout is refused."""
    p = config.parallel
    chunks = p.pipeline_parallel * (p.virtual_pipeline or 1)
    return config.model.num_layers // chunks if chunks else 0


def _check_parallel_layout(config: RunConfig, check: _Checks) -> None:
    """Pipeline, virtual pipeline and sequence parallelism against the model and backend."""
    m, p, t = config.model, config.parallel, config.train
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
    check(
        not (
            config.backend == "transformer_engine"
            and p.sequence_parallel
            and t.engine == "deepspeed"
        ),
        "backend=transformer_engine with parallel.sequence_parallel=true and "
        "train.engine=deepspeed: Transformer Engine's norms leave the sum of their "
        "sequence-parallel gradients to Megatron's finalize_model_grads, which only "
        "train.engine=megatron runs; use train.engine=megatron, or backend=local",
    )


def _check_recompute(t: TrainConfig, layers_per_chunk: int, check) -> None:
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
    p, t = config.parallel, config.train
    pp = p.pipeline_parallel
    check(
        not (t.overlap_grad_reduce and t.engine == "megatron" and pp > 1 and not hardware.cuda),
        f"train.overlap_grad_reduce=true with parallel.pipeline_parallel={pp} hangs on CPU "
        "(gloo); set train.overlap_grad_reduce=false on CPU",
    )
    if config.backend == "transformer_engine":
        check(
            hardware.transformer_engine,
            "backend=transformer_engine but Transformer Engine is not importable here; set "
            "backend=local (every layout runs with it, sequence parallelism included) or "
            "install transformer-engine[pytorch] built for this torch and CUDA",
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
    _check_sizes(config, world_size, check)
    if check.errors:
        return check.errors
    _check_model_shape(config.model, config.parallel.tensor_parallel, check)
    _check_engine(config.train, config.parallel.pipeline_parallel, check)
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

"""The run configuration's schema: dataclasses are the one source of truth.

YAML files under ``configs/`` are serialised instances (``config/load.py`` reads them);
``config/checks.py`` checks a whole config. Torch-free.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

from cqk_megatron.errors import Refusal

# The couplings, scorings and named variants (presets of the two) are the registry's, as
# live views: a coupling registered later (docs/variants.md) is in them too. The
# registry is torch-free, like this module.
from cqk_megatron.variants import (
    variant_name,
)

_T = TypeVar("_T")

CONFIGS_DIR = Path(__file__).resolve().parent.parent.parent / "configs"

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
# planner (perf/memory.py, perf/fit.py) offers exactly these.
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
    # how the coupling runs: eager (the fused form of model/attention/fast_coupling.py, run
    # eagerly; the parameters are plain_math.py's) | compiled (the same under torch.compile)
    # | auto (compiled on GPU, where it saves kernels; eager on CPU, where compiling costs
    # more than it saves); all compute plain_math.py's function
    coupling_impl: str = "auto"
    recompute_coupling: bool = False  # recompute the coupling in backward, store only q, k
    # differential scoring: paired (2 attention calls, values 2 head_dim wide) | split (4
    # calls, for kernels needing values as wide as queries) | auto (from transformer_impl,
    # the device and the SDPA kernel)
    differential_kernel: str = "auto"
    # differential scoring, what follows out1 - lambda out2 in each differential head:
    # paper (RMSNorm over 2 head_dim times 1 - lambda_init, Ye et al.; the ladder's sizes,
    # where the paper measured it) | none (no norm: at the demo's 3M parameters it closes
    # differential's 24% gap to standard, docs/results.md) | small_start (the paper's norm,
    # its weight starting at 0.1, about standard attention's output scale at initialisation)
    differential_norm: str = "paper"
    # differential scoring, lambda_init (lambda's constant term, and the paper's norm's
    # 1 - lambda_init factor): null for the paper's 0.8 - 0.6 exp(-0.3 layer) (0-based
    # layer index: 0.2 in the first layer, towards 0.8 deeper) | a number in [0, 1), the
    # same in every layer (the paper's ablation used 0.8 and 0.5)
    differential_lambda_init: float | None = None

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
class CheckpointSettings:
    """When a run saves and what it keeps (``train.checkpoint.*``; docs/checkpoints.md)."""

    save_interval: int = 100  # in optimizer steps; and at the end of the run
    keep_last: int = 3
    hashes: bool = True  # each file's xxh3-128 in the manifest (else sizes only)
    # a save stages the state in host memory and training goes on while a background
    # thread writes it; committed (manifest, rename, latest) only once every rank's write
    # has finished (docs/checkpoints.md). null (the default): on on GPU, off on CPU
    async_save: bool | None = None


@dataclass
class OptimizerSettings:
    """AdamW's settings (``train.optimizer.*``), which every engine's optimizer takes."""

    lr: float = 3e-4  # the peak learning rate, which the schedule warms up to
    weight_decay: float = 0.1  # not on vectors and scalars (norms, biases, dt, lambda)
    beta1: float = 0.9  # AdamW's first-moment decay (Megatron's adam_beta1)
    beta2: float = 0.95  # AdamW's second-moment decay (Megatron's adam_beta2)
    eps: float = 1e-8  # AdamW's denominator term (Megatron's adam_eps)
    clip_grad: float = 1.0  # the global gradient norm's bound; 0 disables clipping


@dataclass
class ScheduleSettings:
    """The learning rate's course over the run (``train.schedule.*``): a linear warmup to
    ``train.optimizer.lr``, then ``decay`` down to ``min_lr`` (training/lr_schedule.py).
    ``min_lr`` is here rather than in ``train.optimizer``: it is the schedule's floor (AdamW
    has no such setting), and a resume compares it with the schedule's other keys."""

    decay: str = "cosine"  # after the warmup: cosine | wsd (warmup-stable-decay) | constant
    warmup_steps: int = 10
    min_lr: float = 3e-5  # where cosine and wsd end, at train.train_steps
    wsd_decay_fraction: float = 0.2  # wsd: the last fraction of steps decays linearly


@dataclass
class ResilienceSettings:
    """What a run does about faults (``train.resilience.*``; docs/faults.md): non-finite
    steps, a time budget or step to stop at for requeue, replica checks, and the
    watchdog's bounds."""

    max_nan_steps: int = 5  # abort after this many skipped (non-finite) steps in a row
    wall_clock_budget_s: float | None = None  # checkpoint and exit for requeue after this
    exit_after_steps: int | None = None  # checkpoint and exit for requeue at this step
    # every this many steps, and at the end, check that every parameter that must be the
    # same on several ranks is, bit for bit (data-parallel replicas, parameters whole on
    # every tensor-parallel rank, tied embedding copies across pipeline stages); the run
    # stops naming the first that differs and the ranks (training/replicas.py). 0: off
    check_replicas_interval: int = 0
    # faults (training/resilience/watchdog.py): no rank waits forever. Rendezvous, process-group
    # creation, start-up and the first step are bounded by init_timeout_s; after the first step
    # every process group's collectives time out after collective_timeout_s (raised to
    # save_timeout_s + heartbeat_timeout_s during a checkpoint save). Each rank's watchdog
    # heartbeats through the job's TCPStore every heartbeat_interval_s; a rank silent for
    # heartbeat_timeout_s, or one whose main thread stays longer than its bound in a phase (a step
    # or a data fetch: step_timeout_s; a save: save_timeout_s), ends the job with exit 76 and a line
    # naming it. Anchors: torchtitan 300 s / 100 s, torchft heartbeats every 5 s,
    # nvidia-resiliency-ext 60 s / 90 s soft / hard.
    init_timeout_s: float = 300.0
    collective_timeout_s: float = 100.0
    step_timeout_s: float = 60.0
    save_timeout_s: float = 600.0
    heartbeat_interval_s: float = 5.0
    heartbeat_timeout_s: float = 30.0


@dataclass
class TrainConfig:
    """The training loop: batches, precision, steps, engine, recompute and evaluation here;
    the optimizer, schedule, checkpoint and resilience settings in sections of their own."""

    # Keys moved into a section in this release: the old name is still read, with a
    # FutureWarning naming the new one (``RunConfig.RENAMED_KEYS``).
    RENAMED_KEYS: typing.ClassVar[dict[str, str]] = {
        "save_interval": "checkpoint.save_interval",
        "keep_last": "checkpoint.keep_last",
        "checkpoint_hashes": "checkpoint.hashes",
        "async_save": "checkpoint.async_save",
        "lr": "optimizer.lr",
        "weight_decay": "optimizer.weight_decay",
        "adam_beta1": "optimizer.beta1",
        "adam_beta2": "optimizer.beta2",
        "adam_eps": "optimizer.eps",
        "clip_grad": "optimizer.clip_grad",
        "lr_schedule": "schedule.decay",
        "warmup_steps": "schedule.warmup_steps",
        "min_lr": "schedule.min_lr",
        "wsd_decay_fraction": "schedule.wsd_decay_fraction",
        "max_nan_steps": "resilience.max_nan_steps",
        "wall_clock_budget_s": "resilience.wall_clock_budget_s",
        "exit_after_steps": "resilience.exit_after_steps",
        "check_replicas_interval": "resilience.check_replicas_interval",
        "init_timeout_s": "resilience.init_timeout_s",
        "collective_timeout_s": "resilience.collective_timeout_s",
        "step_timeout_s": "resilience.step_timeout_s",
        "save_timeout_s": "resilience.save_timeout_s",
        "heartbeat_interval_s": "resilience.heartbeat_interval_s",
        "heartbeat_timeout_s": "resilience.heartbeat_timeout_s",
    }

    micro_batch_size: int = 2
    global_batch_size: int = 8
    precision: str = "fp32"  # fp32 | bf16 | fp64 (numerical checks on CPU)
    train_steps: int = 100
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    schedule: ScheduleSettings = field(default_factory=ScheduleSettings)
    # data-parallel engine: deepspeed (ZeRO) | megatron (Megatron-Core DDP + distributed
    # optimizer, CPU and GPU) | one registered with training.engines.register_engine
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
    # evaluation (in optimizer steps)
    eval_interval: int = 50
    eval_iters: int = 4  # global batches of the validation split per evaluation
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    resilience: ResilienceSettings = field(default_factory=ResilienceSettings)
    init_from: str | None = None  # weights-only checkpoint to start from (any layout)
    log_interval: int = 1


@dataclass
class LogConfig:
    """Where a run writes: ``root/name`` holds config, metrics, checkpoints, logs."""

    root: str = "runs"
    # offline | online | disabled. online: with the credentials wandb finds (WANDB_API_KEY,
    # or ~/.netrc as `wandb login` writes it), else offline, said once
    wandb_mode: str = "offline"
    wandb_project: str = "cqk-megatron"
    tags: list[str] = field(default_factory=list)
    tensorboard: bool = False
    progress_bar: str = "auto"  # auto (only on a terminal) | on | off
    # dense peak TFLOP/s of one device, the denominator of the MFU that the console line and
    # metrics show; None: the GPU's from its name (perf/flops.py), n/a on CPU
    peak_tflops: float | None = None


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
class CardConfig:
    """The Hugging Face model card's metadata that ``cqk convert export`` writes (its
    ``--license``, ``--datasets``, ``--base-model`` win); Hub identifiers, e.g. ``apache-2.0``,
    ``HuggingFaceFW/fineweb``. Unset: left out of the card."""

    license: str | None = None
    datasets: list[str] = field(default_factory=list)
    base_model: str | None = None  # the model this one was trained from (train.init_from's)


@dataclass
class RunConfig:
    # Keys renamed in this release: the old name is still read, with a FutureWarning, so
    # that older configs, checkpoints and wandb runs load. "backend" named the layers'
    # implementation but is also the launcher's word (--cluster local|slurm).
    RENAMED_KEYS: typing.ClassVar[dict[str, str]] = {"backend": "transformer_impl"}

    name: str = "run"
    seed: int = 1234
    # the layers' implementation, as Megatron-LM's --transformer-impl: local (Megatron-Core's
    # PyTorch layers, any device) | transformer_engine (GPU, where installed)
    transformer_impl: str = "local"
    model: ModelConfig = field(default_factory=ModelConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    log: LogConfig = field(default_factory=LogConfig)
    card: CardConfig = field(default_factory=CardConfig)


# ---------------------------------------------------------------------------------------
# dict <-> dataclass
# ---------------------------------------------------------------------------------------


def _unknown_key_error(key: str, where: str, cls: type, source: str) -> ConfigError:
    names = [f.name for f in dataclasses.fields(cls)]
    known = _suggestions(cls)
    close = difflib.get_close_matches(key, list(known), n=1)
    hint = (
        f"did you mean '{where}{known[close[0]]}'?" if close else f"known keys: {', '.join(names)}"
    )
    return ConfigError(f"{source}: unknown key '{where}{key}'; {hint}")


def _suggestions(cls: type) -> dict[str, str]:
    """A key someone may mean -> the key to suggest: ``cls``'s fields, and the keys of its
    sections and its old names under the name they have now (``lr`` -> ``optimizer.lr``),
    so that a misspelt key that moved into a section is pointed there."""
    known: dict[str, str] = {}
    for name, section in _sections(cls).items():
        known.update({f.name: f"{name}.{f.name}" for f in dataclasses.fields(section)})
    known.update(getattr(cls, "RENAMED_KEYS", {}))
    known.update({f.name: f.name for f in dataclasses.fields(cls)})  # a field's own name wins
    return known


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
        cls = cast(type, annotation)  # is_dataclass is also true of an instance: never one here
        return from_dict(cls, {} if value is None else value, source, f"{dotted}.")
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


def _coerce_union(options: list[Any], value: Any, dotted: str, source: str) -> Any:
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


def from_dict(cls: type[_T], data: dict[str, Any], source: str = "config", prefix: str = "") -> _T:
    """Build dataclass ``cls`` from a nested dict, refusing unknown keys, bad types and
    missing required keys: the one typed reader of runs, sweeps and cluster profiles."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: '{prefix.rstrip('.') or 'top level'}' must be a mapping")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cast(Any, cls)) if f.init}
    kwargs = {}
    for key, value in renamed_keys(cls, data, source, prefix).items():
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


def renamed_keys(cls: type, data: dict[str, Any], source: str, prefix: str = "") -> dict[str, Any]:
    """``data`` with the keys ``cls.RENAMED_KEYS`` names under their new names; an old
    name warns, and an old and a new name together must agree."""
    renamed = dict(data)
    for old, new in getattr(cls, "RENAMED_KEYS", {}).items():
        if old not in renamed:
            continue
        value = renamed.pop(old)
        *sections, key = new.split(".")  # a key moved into a section: "checkpoint.keep_last"
        node = renamed
        for section in sections:
            node[section] = node = dict(node.get(section) or {})
        if key in node and node[key] != value:
            raise ConfigError(
                f"{source}: '{prefix}{old}' (the old name of '{prefix}{new}') is {value!r} but "
                f"'{prefix}{new}' is {node[key]!r}; keep only '{prefix}{new}'"
            )
        node[key] = value
        warnings.warn(
            f"{source}: '{prefix}{old}' is now '{prefix}{new}'; the old name is read for "
            "one more release",
            FutureWarning,
            stacklevel=3,
        )
    return renamed


def renamed_tree(cls: type, data: dict[str, Any], source: str, prefix: str = "") -> dict[str, Any]:
    """``renamed_keys`` in ``data`` and in each of its sections that is a dataclass of
    ``cls`` (``train`` in a run config), so that a file's old name and an included file's
    new one meet under the new name."""
    renamed = renamed_keys(cls, data, source, prefix)
    sections = _sections(cls)
    for key, value in renamed.items():
        if isinstance(value, dict) and key in sections:
            renamed[key] = renamed_tree(sections[key], value, source, f"{prefix}{key}.")
    return renamed


def renamed_path(keys: list[str], source: str, warn: bool = True) -> list[str]:
    """An override's keys (``train.keep_last``) with old names as their new ones
    (``train.checkpoint.keep_last``), walking ``RunConfig``'s sections; an old name warns."""
    section: Any = RunConfig
    out: list[str] = []
    for key in keys:
        moved = getattr(section, "RENAMED_KEYS", {}).get(key) if section else None
        if moved and warn:
            renamed_keys(section, {key: None}, source, "".join(f"{k}." for k in out))
        for part in moved.split(".") if moved else [key]:
            out.append(part)
            section = _sections(section).get(part) if section else None
    return out


def _sections(cls: type) -> dict[str, type]:
    """``cls``'s fields that are sections of their own, by name (a dataclass each:
    ``train.optimizer``, ``train.checkpoint``, ...)."""
    return {
        name: hint
        for name, hint in typing.get_type_hints(cls).items()
        if isinstance(hint, type) and dataclasses.is_dataclass(hint)
    }


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested dict as ``{dotted key: value}`` (lists are values), as overrides name keys."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)

"""Memory planner: will a layout fit, and which layouts fit?

``check_fits`` is what the training command calls before it launches; ``plan_layout``
gives one layout's memory stage by stage and ``plan_all`` every layout of a number of
GPUs (TP in 1, 2, 4, 8; PP dividing the layers; DP = the rest; each ZeRO stage). All
numbers are per GPU, for the pipeline stage that needs the most. The command line is
``cqk plan`` (``cqk_megatron.cli.plan``).

The planner offers exactly what training runs: each layout is a training config
(``training_config``: parallel sizes, ``train.engine``/``zero_stage``, ``train.recompute*``)
that ``config.validate`` accepts on ``--gpus`` ranks, and the command prints, for the
layouts that fit, the overrides that run them.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from cqk_megatron.config import ConfigError, RunConfig, validate
from cqk_megatron.model.params import embedding_parameters, stage_parameters
from cqk_megatron.parallel.layout import Layout
from cqk_megatron.perf.memory import (
    RECOMPUTE,
    activation_estimate,
    engine_buffer_bytes,
    microbatches_in_flight,
    model_state_bytes,
    stage_activation_bytes,
    zero3_persistent_parameters,
)
from cqk_megatron.perf.traffic import reduce_bucket_elements
from cqk_megatron.training.engines import (
    SHARDINGS,
    SHIPPED_SHARDINGS,
    engine_of,
    sharding_settings,
    zero_aliases,
)

GIB = 2**30
# CUDA context, NCCL buffers and allocator fragmentation: memory no estimate here covers.
DEFAULT_RESERVE_BYTES = 4 * GIB
TP_SIZES = (1, 2, 4, 8)
# What training runs: the shipped engines' shardings, DeepSpeed ZeRO-1/2/3 and Megatron's
# distributed optimizer (plain DDP, "ddp", is an estimate for the benchmark's own optimizer
# only). With PP > 1 only those that allow it (``Sharding.with_pipeline``).
TRAINING_SHARDINGS = SHIPPED_SHARDINGS


class PlanError(ConfigError):
    """A layout that cannot fit in GPU memory; the message carries the numbers."""


def parse_bytes(text: str) -> int:
    """``80GiB``, ``80GB``, ``512MiB`` or a plain number of bytes."""
    units = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    units |= {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match[2].lower() not in units:
        raise ValueError(f"cannot read a memory size from {text!r}; write e.g. 80GiB or 80GB")
    return int(float(match[1]) * units[match[2].lower()])


def normalize_sharding(sharding: str | int) -> str:
    name = zero_aliases().get(str(sharding), str(sharding))
    if name not in SHARDINGS:
        raise ValueError(
            f"sharding {sharding!r} is unknown; choose one of {list(SHARDINGS)} or 0-3"
        )
    return name


@dataclass
class StageMemory:
    """Bytes on one GPU of pipeline stage ``stage``."""

    stage: int
    parameters: int
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.parts.values())


@dataclass
class PlanResult:
    config_name: str
    variant: str
    layout: Layout
    micro_batch: int
    seq_length: int
    gpu_mem_bytes: int
    reserve_bytes: int
    stages: list[StageMemory]
    message: str = ""

    @property
    def worst(self) -> StageMemory:
        return max(self.stages, key=lambda stage: stage.total)

    @property
    def usable_bytes(self) -> int:
        return self.gpu_mem_bytes - self.reserve_bytes

    @property
    def fits(self) -> bool:
        return self.worst.total <= self.usable_bytes

    def require(self) -> PlanResult:
        """Raise ``PlanError`` with the numbers if the layout does not fit."""
        if not self.fits:
            raise PlanError(self.message)
        return self


def gib(value: float) -> str:
    return f"{value / GIB:.1f} GiB"


def memory_parts(stage: StageMemory) -> str:
    """``parameters 1.2 GiB, gradients ...``: a stage's memory by part (under ZeRO-3 with
    the whole parameters it gathers and keeps beside its partitions)."""
    return ", ".join(f"{name} {gib(value)}" for name, value in stage.parts.items())


def _summary(result: PlanResult) -> str:
    worst = result.worst
    parts = memory_parts(worst)
    verdict = "fits" if result.fits else "does not fit"
    return (
        f"{result.config_name} ({result.variant}) {result.layout.describe()}, micro-batch "
        f"{result.micro_batch} x seq {result.seq_length}: {verdict}: stage {worst.stage} "
        f"needs {gib(worst.total)} ({parts}); usable {gib(result.usable_bytes)} of "
        f"{gib(result.gpu_mem_bytes)} ({gib(result.reserve_bytes)} reserved)"
    )


def plan_layout(
    config: RunConfig,
    layout: Layout,
    micro_batch: int,
    gpu_mem_bytes: int,
    seq_length: int | None = None,
    num_microbatches: int | None = None,
    reserve_bytes: int = DEFAULT_RESERVE_BYTES,
    recompute_coupling: bool = False,
    offload_optimizer: bool = False,
    config_name: str = "model",
) -> PlanResult:
    """Memory of every pipeline stage of ``layout`` (``num_microbatches`` None: the
    pipeline is full, the worst case)."""
    m = config.model
    seq = seq_length or m.seq_length
    tp, pp = layout.tp, layout.pp
    act = activation_estimate(
        config,
        micro_batch,
        seq,
        tp=tp,
        sequence_parallel=layout.sequence_parallel,
        recompute=layout.recompute,
        recompute_coupling=recompute_coupling,
    )
    layers = m.num_layers // pp
    layer_bytes, rebuild_bytes = stage_activation_bytes(
        act,
        layers,
        layout.vp or 1,
        layout.recompute,
        layout.recompute_method,
        layout.recompute_num_layers,
    )
    offload = offload_optimizer and layout.optimizer_sharding.startswith("zero")  # DeepSpeed only
    stages = []
    for stage in range(pp):
        first, last = stage == 0, stage == pp - 1
        params = stage_parameters(config, tp, pp, first=first, last=last)
        parts = model_state_bytes(
            params, config.train.precision, layout.optimizer_sharding, layout.dp, offload
        )
        buffers = stage_buffers(config, layout, params, first, last)
        parts["buffers"] = buffers["reduce_buckets"]
        if layout.optimizer_sharding == "zero3":  # whole parameters beside its partitions
            parts["gathered"] = buffers["gathered_parameters"]
            parts["persistent"] = buffers["persistent_parameters"]
        in_flight = microbatches_in_flight(pp, stage, num_microbatches, layout.vp)
        one_microbatch = (
            layer_bytes
            + (act.embedding_bytes if first else 0.0)
            + (act.output_bytes if last else 0.0)
        )
        parts["activations"] = one_microbatch * in_flight
        # the fp32 copy of a gradient bucket is made after the backward's rebuilds
        transient = max(
            act.logits_transient_bytes if last else 0.0, rebuild_bytes, buffers["reduction_copy"]
        )
        parts["transient"] = transient
        stages.append(StageMemory(stage=stage, parameters=params, parts=parts))
    result = PlanResult(
        config_name=config_name,
        variant=config.attention.variant,
        layout=layout,
        micro_batch=micro_batch,
        seq_length=seq,
        gpu_mem_bytes=gpu_mem_bytes,
        reserve_bytes=reserve_bytes,
        stages=stages,
    )
    result.message = _summary(result)
    return result


def stage_buffers(
    config: RunConfig, layout: Layout, params: int, first: bool, last: bool
) -> dict[str, float]:
    """``engine_buffer_bytes`` of a rank of the first and/or last pipeline stage."""
    tp, pp = layout.tp, layout.pp
    zero3 = layout.optimizer_sharding == "zero3"
    return engine_buffer_bytes(
        params,
        config.train.precision,
        layout.optimizer_sharding,
        reduce_bucket_elements(params, layout.dp),
        config.train.overlap_grad_reduce,
        largest_parameter(config, tp, first or last),
        zero3_persistent_parameters(config, tp, pp, first, last) if zero3 else 0,
    )


def largest_parameter(config: RunConfig, tp: int, holds_vocabulary: bool) -> int:
    """Elements of the largest parameter on a TP rank: the vocabulary table (first and last
    stage), the fused QKV or the fused gate/up matrix."""
    m = config.model
    qkv = m.hidden_size * (m.num_attention_heads + 2 * m.kv_heads) * m.head_dim
    fc1 = m.hidden_size * m.ffn_size * (2 if m.swiglu else 1)
    table = embedding_parameters(config, 1) if holds_vocabulary else 0
    return max(qkv, fc1, table) // tp


def default_global_batch(config: RunConfig, micro_batch: int, dp: int) -> int:
    """The config's global batch where ``micro_batch x dp`` divides it, else one
    micro-batch per data-parallel rank (the smallest that runs)."""
    own = config.train.global_batch_size
    return own if own % (micro_batch * dp) == 0 else micro_batch * dp


def training_config(
    config: RunConfig,
    layout: Layout,
    micro_batch: int,
    global_batch: int | None = None,
    offload_optimizer: bool | None = None,
) -> RunConfig:
    """``config`` set up to train ``layout`` (what ``layout_overrides`` prints)."""
    if layout.optimizer_sharding not in TRAINING_SHARDINGS:
        raise ConfigError(
            f"sharding {layout.optimizer_sharding!r} is not one that training runs; choose one of "
            f"{list(TRAINING_SHARDINGS)}"
        )
    parallel = dataclasses.replace(
        config.parallel,
        tensor_parallel=layout.tp,
        pipeline_parallel=layout.pp,
        virtual_pipeline=layout.vp,
        sequence_parallel=layout.sequence_parallel,
        world_size=layout.tp * layout.pp * layout.dp,
    )
    full = layout.recompute == "full"
    train = dataclasses.replace(
        config.train,
        **sharding_settings(layout.optimizer_sharding),
        micro_batch_size=micro_batch,
        global_batch_size=global_batch or default_global_batch(config, micro_batch, layout.dp),
        recompute=layout.recompute,
        recompute_method=layout.recompute_method if full else config.train.recompute_method,
        recompute_num_layers=layout.recompute_num_layers if full else None,
    )
    if offload_optimizer is not None:
        train = dataclasses.replace(train, offload_optimizer=offload_optimizer)
    return dataclasses.replace(config, parallel=parallel, train=train)


def layout_overrides(config: RunConfig) -> list[str]:
    """The ``section.key=value`` overrides that set a ``training_config``'s layout, every key
    spelled out, so that they apply whatever the run's YAML file sets."""
    p, t = config.parallel, config.train

    def value(v) -> str:
        return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)

    overrides = [
        f"parallel.tensor_parallel={p.tensor_parallel}",
        f"parallel.pipeline_parallel={p.pipeline_parallel}",
        f"parallel.virtual_pipeline={value(p.virtual_pipeline)}",
        f"parallel.sequence_parallel={value(p.sequence_parallel)}",
        f"train.engine={t.engine}",
        f"train.zero_stage={t.zero_stage}",
        f"train.micro_batch_size={t.micro_batch_size}",
        f"train.global_batch_size={t.global_batch_size}",
        f"train.recompute={t.recompute}",
        f"train.recompute_method={t.recompute_method}",
        f"train.recompute_num_layers={value(t.recompute_num_layers)}",
        f"train.offload_optimizer={value(t.offload_optimizer)}",
    ]
    if config.attention.recompute_coupling:
        overrides.append("attention.recompute_coupling=true")
    return overrides


def runnable(
    config: RunConfig,
    layout: Layout,
    micro_batch: int,
    global_batch: int | None = None,
    offload_optimizer: bool | None = None,
) -> bool:
    """Whether training accepts ``layout`` (``validate`` on its world size)."""
    try:
        built = training_config(config, layout, micro_batch, global_batch, offload_optimizer)
        validate(built, built.parallel.world_size)
    except ConfigError:
        return False
    return True


def sharding_of(config: RunConfig) -> str:
    """The planner's sharding name for ``train.engine`` / ``train.zero_stage``."""
    return engine_of(config).sharding_at(config.train.zero_stage)


def enumerate_layouts(
    config: RunConfig,
    gpus: int,
    shardings: tuple[str, ...] = TRAINING_SHARDINGS,
    recomputes: tuple[str, ...] = ("none",),
    sequence_parallel: bool | None = None,
    micro_batch: int | None = None,
    global_batch: int | None = None,
    recompute_method: str = "uniform",
    recompute_num_layers: int | None = None,
    offload_optimizer: bool | None = None,
) -> list[Layout]:
    """Every layout of ``gpus`` GPUs that training accepts: TP in 1, 2, 4, 8, PP dividing
    the layers, DP the rest, each sharding and recompute choice, each checked with
    ``validate`` as the training config it stands for (``micro_batch`` None: the
    config's); ``sequence_parallel`` None: on when TP > 1."""
    micro_batch = micro_batch or config.train.micro_batch_size
    layouts = []
    for tp in TP_SIZES:
        for pp in range(1, config.model.num_layers + 1):
            if config.model.num_layers % pp or gpus % (tp * pp):
                continue
            sp = (tp > 1) if sequence_parallel is None else (sequence_parallel and tp > 1)
            for sharding in shardings:
                if pp > 1 and not SHARDINGS[sharding].with_pipeline:
                    continue
                for recompute in recomputes:
                    full = recompute == "full"
                    layout = Layout(
                        tp,
                        pp,
                        gpus // (tp * pp),
                        sharding,
                        recompute,
                        None,
                        sp,
                        recompute_method if full else "uniform",
                        recompute_num_layers if full else None,
                    )
                    if runnable(config, layout, micro_batch, global_batch, offload_optimizer):
                        layouts.append(layout)
    return layouts


def microbatches_per_step(global_batch: int | None, micro_batch: int, dp: int) -> int | None:
    """Micro-batches per step on each DP rank; None (a full pipeline) when unknown."""
    if not global_batch:
        return None
    return global_batch // (micro_batch * dp) or None


def plan_all(
    config: RunConfig,
    gpus: int,
    gpu_mem_bytes: int,
    micro_batch: int,
    global_batch: int | None = None,
    **options,
) -> list[PlanResult]:
    """``plan_layout`` for every layout of ``enumerate_layouts`` (whose options
    ``shardings``, ``recomputes``, ``sequence_parallel`` pass through)."""
    names = ("shardings", "recomputes", "sequence_parallel", "recompute_method")
    layout_options = {k: options.pop(k) for k in (*names, "recompute_num_layers") if k in options}
    layout_options["offload_optimizer"] = options.get("offload_optimizer")
    return [
        plan_layout(
            config,
            layout,
            micro_batch,
            gpu_mem_bytes,
            num_microbatches=microbatches_per_step(global_batch, micro_batch, layout.dp),
            **options,
        )
        for layout in enumerate_layouts(
            config, gpus, micro_batch=micro_batch, global_batch=global_batch, **layout_options
        )
    ]


def gpu_memory_bytes() -> int | None:
    """Total memory of the current CUDA device, None without one."""
    import torch

    from cqk_megatron.parallel.device import device

    here = device()
    if here.type != "cuda":
        return None
    return torch.cuda.get_device_properties(here).total_memory


def own_layout(
    config: RunConfig, world_size: int, sharding: str | int | None, recompute: str | None
) -> Layout:
    """``config``'s own layout on ``world_size`` GPUs (``sharding``/``recompute`` None: the
    config's)."""
    p, t = config.parallel, config.train
    if recompute is None:
        recompute = t.recompute
    if recompute not in RECOMPUTE:
        raise ConfigError(f"recompute={recompute!r} is unknown; choose one of {list(RECOMPUTE)}")
    sharding = sharding_of(config) if sharding is None else normalize_sharding(sharding)
    tp, pp = p.tensor_parallel, p.pipeline_parallel
    if world_size % (tp * pp):
        raise ConfigError(
            f"world size {world_size} is not divisible by parallel.tensor_parallel={tp} x "
            f"parallel.pipeline_parallel={pp}"
        )
    full = recompute == "full"
    return Layout(
        tp,
        pp,
        world_size // (tp * pp),
        sharding,
        recompute,
        p.virtual_pipeline,
        p.sequence_parallel,
        t.recompute_method if full else "uniform",
        t.recompute_num_layers if full else None,
    )


def layouts_that_fit_hint(
    config: RunConfig, world_size: int, gpu_mem_bytes: int, reserve_bytes: int
) -> str:
    """The three layouts of the same GPUs that fit, with the overrides that train them
    (least model parallelism and recomputation first: usually the fastest), or what to
    change when none does."""
    t = config.train
    alternatives = [
        r
        for r in plan_all(
            config,
            world_size,
            gpu_mem_bytes,
            t.micro_batch_size,
            global_batch=t.global_batch_size,
            recomputes=RECOMPUTE,
            reserve_bytes=reserve_bytes,
            offload_optimizer=t.offload_optimizer,
        )
        if r.fits
    ]
    if not alternatives:
        return (
            "no layout of these GPUs fits at this micro-batch; lower "
            "train.micro_batch_size or model.seq_length, or use more GPUs"
        )
    alternatives.sort(
        key=lambda r: (
            r.layout.tp * r.layout.pp,
            RECOMPUTE.index(r.layout.recompute),
            r.worst.total,
        )
    )

    def how(r: PlanResult) -> str:
        built = training_config(config, r.layout, t.micro_batch_size, t.global_batch_size)
        return f"{r.layout.describe()} ({gib(r.worst.total)}: {' '.join(layout_overrides(built))})"

    return "layouts of these GPUs that fit: " + "; ".join(how(r) for r in alternatives[:3])


def check_fits(
    config: RunConfig,
    world_size: int,
    gpu_mem_bytes: int,
    sharding: str | int | None = None,
    recompute: str | None = None,
    reserve_bytes: int = DEFAULT_RESERVE_BYTES,
    recompute_coupling: bool | None = None,
) -> PlanResult:
    """The plan of ``config``'s own layout on ``world_size`` GPUs (before launching).

    ``result.fits`` says whether it fits, ``result.message`` gives the numbers (and, if it
    does not fit, layouts of the same GPUs that do); ``result.require()`` raises
    ``PlanError`` with that message. ``sharding``: ``ddp``, ``zero1``-``zero3`` (or 0-3),
    ``distopt``; None: from ``train.engine`` and ``train.zero_stage``. ``recompute``
    None: ``train.recompute`` (with its method and number of layers);
    ``recompute_coupling`` None: ``config.attention.recompute_coupling``.
    """
    t = config.train
    if recompute_coupling is None:
        recompute_coupling = config.attention.recompute_coupling
    layout = own_layout(config, world_size, sharding, recompute)
    result = plan_layout(
        config,
        layout,
        t.micro_batch_size,
        gpu_mem_bytes,
        num_microbatches=microbatches_per_step(t.global_batch_size, t.micro_batch_size, layout.dp),
        reserve_bytes=reserve_bytes,
        recompute_coupling=recompute_coupling,
        offload_optimizer=t.offload_optimizer,
        config_name=config.name,
    )
    if not result.fits:
        hint = layouts_that_fit_hint(config, world_size, gpu_mem_bytes, reserve_bytes)
        result.message += f"; {hint}"
    return result


# ---------------------------------------------------------------------------------------
# the planner's tables (``cqk plan`` prints them)
# ---------------------------------------------------------------------------------------


def format_stages(result: PlanResult) -> str:
    names = list(result.stages[0].parts)
    header = f"{'stage':>5} {'params':>14} " + " ".join(f"{n:>12}" for n in names)
    lines = [header + f" {'total':>10}"]
    for stage in result.stages:
        values = " ".join(f"{stage.parts[n] / GIB:>12.2f}" for n in names)
        lines.append(
            f"{stage.stage:>5} {stage.parameters:>14,} {values} {stage.total / GIB:>10.2f}"
        )
    return "\n".join(lines) + "\n(GiB per GPU)"


def format_layouts(results: list[PlanResult]) -> str:
    lines = [
        f"{'TP':>3} {'PP':>3} {'DP':>3} {'SP':>3} {'engine':>8} {'recompute':>16} "
        f"{'states':>8} {'activ.':>8} {'transient':>9} {'total':>8} {'fits':>5}"
    ]
    for r in results:
        w, lay = r.worst, r.layout
        states = w.total - w.parts["activations"] - w.parts["transient"]
        lines.append(
            f"{lay.tp:>3} {lay.pp:>3} {lay.dp:>3} {'on' if lay.sequence_parallel else '-':>3} "
            f"{lay.optimizer_sharding:>8} {lay.recompute_label():>16} {states / GIB:>8.1f} "
            f"{w.parts['activations'] / GIB:>8.1f} {w.parts['transient'] / GIB:>9.1f} "
            f"{w.total / GIB:>8.1f} {'yes' if r.fits else 'no':>5}"
        )
    return "\n".join(lines) + "\n(GiB per GPU, worst pipeline stage)"


RUN_PREFIX = "  run: "  # how --show-overrides starts each line (tests parse it)


def format_overrides(
    config: RunConfig, results: list[PlanResult], micro_batch: int, global_batch: int | None
) -> str:
    """For each layout that fits, the overrides that train it (``--show-overrides``)."""
    lines = []
    for r in results:
        if r.fits:
            built = training_config(config, r.layout, micro_batch, global_batch)
            lines.append(RUN_PREFIX + " ".join(layout_overrides(built)))
    return "\n".join(lines)

"""Benchmark the attention variants against standard attention, in one run.

    cqk bench [--config tiny|configs/models/350m.yaml]
        [--variants standard,coupled,differential] [--steps 5] [--warmup 1]
        [--micro-batch B] [--seq S] [--attention-only] [--optimizer adamw]
        [--precision fp32|bf16] [--json out.json] [section.key=value ...]

Builds the same model config with each variant (all resident at once), then times
forward + backward (+ an optimizer step with ``--optimizer adamw``) interleaved,
``A B C A B C ...``, for ``--steps`` rounds after ``--warmup`` rounds, so that drift in
the machine's speed hits every variant alike. Reported per variant: the median step
time, tokens/s, the ratio to standard attention (the median over rounds of the
per-round ratio), model FLOPs per token and MFU (GPU), and memory:

- ``act MiB``: bytes autograd keeps for the backward, measured with a saved-tensor
  hook in one extra untimed forward (the only per-variant measure on CPU, where PyTorch
  has no allocator statistics); ``est MiB`` is the planner's estimate of the same.
- ``step MiB`` (GPU): ``torch.cuda.max_memory_allocated`` during a step above what was
  allocated before it (activations, gradients, temporaries).

``--attention-only`` times one ``QKSelfAttention`` layer instead of the model.

A variant name may carry tags that choose how its coupling runs, so that the ways
of running one coupling are timed side by side: ``coupled@compiled`` sets
``attention.coupling_impl=compiled``, ``coupled@eager`` the default fused eager form,
``coupled@reference`` the plain modules of ``plain_math.py`` (a benchmark-only choice;
for differential scoring too: ``differential@split@reference`` is the four calls and
the plain combination of ``DifferentialScoring``, the form that ran before the paired one),
and ``@recompute`` sets ``attention.recompute_coupling=true`` (e.g.
``coupled@compiled@recompute``). On a variant with differential scoring, ``@paired`` and
``@split`` set ``attention.differential_kernel`` (e.g. ``differential@paired,
differential@split``). An untagged name takes the config's settings. The ``attention``
column names the differential form that ran and the kernel(s) its attention ran on,
observed in one profiled forward: SDPA's ``flash``, ``cudnn``, ``efficient`` or ``math``;
``maps`` for ``attention/differential.py``'s ``paired_maps``; ``te`` for Transformer Engine.
On GPU the model is built in bf16 (``train.precision=bf16``) unless ``--precision``
says otherwise; on CPU in the config's precision (fp32 by default).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from cqk_megatron.bench.measure import saved_activation_bytes
from cqk_megatron.config import RunConfig, load_config
from cqk_megatron.model.attention.fast_coupling import RUN_IMPLS
from cqk_megatron.perf.flops import flops_breakdown, flops_per_token, mfu, peak_flops
from cqk_megatron.perf.memory import activation_estimate
from cqk_megatron.planner.runs import plan_config
from cqk_megatron.run.atomic import write_text_atomically
from cqk_megatron.variants import DIFFERENTIAL_KERNELS, pair

# Small enough for a 2-core CPU, with the real models' head_dim of 64.
TINY = [
    "model.num_layers=4",
    "model.hidden_size=256",
    "model.num_attention_heads=4",
    "model.seq_length=256",
    "model.vocab_size=4096",
]
DEFAULT_VARIANTS = "standard,coupled,differential"
MIB = 2**20


def load_bench_config(spec: str, overrides: list[str] | None = None) -> RunConfig:
    """``tiny`` (the built-in CPU size) or a YAML path, with overrides."""
    if spec == "tiny":
        return load_config(None, [*TINY, *(overrides or [])])
    return load_config(spec, overrides)


IMPL_TAGS = RUN_IMPLS  # attention.coupling_impl (+ reference: the plain_math.py module)
KERNEL_TAGS = DIFFERENTIAL_KERNELS  # attention.differential_kernel
VARIANT_TAGS = (*IMPL_TAGS, *KERNEL_TAGS, "recompute")


def split_variant(variant: str) -> tuple[str, list[str]]:
    """``"coupled@compiled@recompute"`` -> ``("coupled", ["compiled", "recompute"])``."""
    name, *tags = variant.split("@")
    _, scoring = pair(name)  # a preset or coupling+scoring; the registry's message if neither
    unknown = [tag for tag in tags if tag not in VARIANT_TAGS]
    impls = [tag for tag in tags if tag in IMPL_TAGS]
    kernels = [tag for tag in tags if tag in KERNEL_TAGS]
    if unknown or len(impls) > 1 or len(kernels) > 1 or len(set(tags)) < len(tags):
        raise ValueError(
            f"variant {variant!r}: tags are at most one of eager/compiled/reference, at most "
            f"one of paired/split and/or recompute, as in coupled@compiled@recompute or "
            f"coupled_differential@paired"
        )
    if kernels and scoring != "differential":
        raise ValueError(
            f"variant {variant!r}: @{kernels[0]} chooses differential attention's form, but "
            f"{name} has {scoring} scoring; use it on a differential variant"
        )
    return name, tags


def variant_of(config: RunConfig, variant: str) -> RunConfig:
    """``config`` with ``variant``'s (coupling, scoring) and tags, on one process, planned
    and validated by the planner (``planner.runs.plan_config``)."""
    name, tags = split_variant(variant)
    attention = config.attention
    for impl in ("eager", "compiled"):
        if impl in tags:
            attention = dataclasses.replace(attention, coupling_impl=impl)
    if "recompute" in tags:
        attention = dataclasses.replace(attention, recompute_coupling=True)
    for kernel in KERNEL_TAGS:
        if kernel in tags:
            attention = dataclasses.replace(attention, differential_kernel=kernel)
    config = dataclasses.replace(config, attention=attention)
    config = plan_config(config, name, single_process=True)
    if "reference" in tags:  # not a config choice, hence set past validation
        attention = dataclasses.replace(config.attention, coupling_impl="reference")
        config = dataclasses.replace(config, attention=attention)
    return config


def init_world(config: RunConfig) -> torch.device:
    """A world of one as the tools have it (NCCL on GPU, gloo on CPU, Megatron groups,
    the CUDA RNG tracker seeded); returns this process's device."""
    from cqk_megatron.parallel.device import device
    from cqk_megatron.parallel.process_groups import init_single_process

    init_single_process(config)
    return device()


def sdpa_kernel_for(kernels: list[str]) -> str:
    """Which SDPA path the planner should assume, from the kernels that ran: ``math``
    where the ``s x s`` maps are kept (SDPA's math path; ``paired_maps``, which keeps
    them block by block), else ``fused``."""
    return "math" if {"math", "maps"} & set(kernels) else "fused"


# The aten ops behind scaled_dot_product_attention, by the kernel each one is.
SDPA_OPS = {
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash",
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_scaled_dot_product_fused_attention_overrideable": "overrideable",
}


def attention_kernels(module: torch.nn.Module, forward: Callable[[], torch.Tensor]) -> dict:
    """Which differential form the model uses and which SDPA kernels one forward ran
    (observed with the profiler, not predicted); ``te`` where Transformer Engine's
    attention runs the paired calls, ``maps`` where ``differential.paired_maps`` does."""
    from torch.profiler import ProfilerActivity, profile

    # with autograd on: a kernel's backward constraints take part in SDPA's choice
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        output = forward()
    del output
    kernels = {SDPA_OPS[e.key] for e in prof.key_averages() if e.key in SDPA_OPS}
    forms = set()
    for sub in module.modules():
        if hasattr(sub, "differential") and hasattr(sub, "last_path"):
            forms.add(sub.kernel)
            if sub.last_path in ("te", "maps"):  # not SDPA: its own kernel
                kernels.add(sub.last_path)
    return {"differential_kernel": "/".join(sorted(forms)) or None, "kernels": sorted(kernels)}


@dataclass
class Workload:
    """One variant, ready to run: ``step()`` does forward + backward (+ optimizer)."""

    variant: str
    config: RunConfig
    module: torch.nn.Module
    step: Callable[[], None]
    forward: Callable[[], torch.Tensor]
    parameters: int
    times: list[float] = field(default_factory=list)
    step_bytes: list[int] = field(default_factory=list)
    activation_bytes: int = 0
    attention: dict = field(default_factory=dict)  # attention_kernels()


def build_workload(
    config: RunConfig,
    variant: str,
    micro_batch: int,
    device: torch.device,
    attention_only: bool = False,
    optimizer: str = "none",
) -> Workload:
    from cqk_megatron.model.gpt import build_model
    from cqk_megatron.parallel.device import to_device

    config = variant_of(config, variant)
    seq, hidden = config.model.seq_length, config.model.hidden_size
    torch.manual_seed(config.seed)
    if attention_only:
        config_one = dataclasses.replace(
            config, model=dataclasses.replace(config.model, num_layers=1)
        )
        model = build_model(config_one)
        module = model.decoder.layers[0].self_attention
        dtype = next(module.parameters()).dtype
        hidden_states = torch.randn(
            seq, micro_batch, hidden, device=device, dtype=dtype, requires_grad=True
        )
        rotary = model.rotary_pos_emb(seq)

        def forward() -> torch.Tensor:
            output, _ = module(hidden_states, None, rotary_pos_emb=rotary)
            return output.float().square().mean()

    else:
        module = build_model(config)
        generator = torch.Generator().manual_seed(config.seed)
        tokens = to_device(
            torch.randint(0, config.model.vocab_size, (micro_batch, seq), generator=generator)
        )
        positions = torch.arange(seq, device=device).expand(micro_batch, seq)

        def forward() -> torch.Tensor:
            return module(tokens, positions, None, labels=tokens).float().mean()

    if config.train.precision == "bf16":
        # Megatron's norms are created in fp32; its Float16Module casts the whole model to
        # bf16 before training, and so do we (else RMSNorm misses its fused kernel)
        module.bfloat16()
    module.train()
    opt = None
    if optimizer == "adamw":
        opt = torch.optim.AdamW(module.parameters(), lr=1e-5, foreach=True)
    elif optimizer != "none":
        raise ValueError(f"optimizer {optimizer!r}: choose none or adamw")

    def step() -> None:
        forward().backward()
        if opt is not None:
            opt.step()
        module.zero_grad(set_to_none=True)  # next step allocates its gradients afresh
        if attention_only:
            hidden_states.grad = None

    parameters = sum(p.numel() for p in module.parameters())
    return Workload(variant, config, module, step, forward, parameters)


def attention_layer_flops(config: RunConfig, seq: int) -> float:
    """Forward FLOPs per token of one attention layer (projections, scores, coupling)."""
    parts = flops_breakdown(config, seq)
    names = ("qkv", "attention_proj", "attention_scores", "attention_context", "coupling")
    return sum(parts[name] for name in names) / config.model.num_layers


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def timed_step(work: Workload, device: torch.device, clock: str = "wall") -> None:
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    now = CLOCKS[clock]
    start = now()
    work.step()
    _sync(device)
    work.times.append(now() - start)
    if device.type == "cuda":
        work.step_bytes.append(torch.cuda.max_memory_allocated(device) - before)


def build_workloads(
    config: RunConfig,
    variants: list[str],
    micro_batch: int,
    device: torch.device,
    attention_only: bool,
    optimizer: str,
    log: Callable[[str], None],
) -> list[Workload]:
    """Every variant built (all resident at once), with its activation bytes and the
    kernels its attention runs on, measured apart from the timed steps."""
    works = []
    for variant in variants:
        log(f"building {variant}")
        works.append(
            build_workload(config, variant, micro_batch, device, attention_only, optimizer)
        )
    for work in works:
        work.activation_bytes = saved_activation_bytes(work.module, work.forward)
        work.attention = attention_kernels(work.module, work.forward)
    return works


def time_rounds(
    works: list[Workload],
    device: torch.device,
    rounds: int,
    warmup: int,
    clock: str,
    log: Callable[[str], None],
) -> None:
    """``A B C A B C ...``: each round steps every variant once, so that drift in the
    machine's speed hits them alike; the warm-up rounds' times are dropped."""
    for round_index in range(warmup + rounds):
        for work in works:
            timed_step(work, device, clock)
            if round_index < warmup:
                work.times.pop()
                if work.step_bytes:
                    work.step_bytes.pop()
        log(f"round {round_index + 1 - warmup}/{rounds}" if round_index >= warmup else "warm-up")


def result_row(
    work: Workload,
    baseline: Workload,
    micro_batch: int,
    seq: int,
    attention_only: bool,
    peak: float | None,
) -> dict:
    """One variant's line of the report: median step time, ratio to the baseline, FLOPs,
    MFU and memory (measured and estimated)."""
    vconfig = work.config
    median = statistics.median(work.times)
    ratio = statistics.median(t / b for t, b in zip(work.times, baseline.times, strict=True))
    tokens_per_s = micro_batch * seq / median
    if attention_only:
        flops = 3 * attention_layer_flops(vconfig, seq)
        estimate = None
        utilisation = tokens_per_s * flops / peak if peak else None
    else:
        flops = flops_per_token(vconfig, training=True, seq_length=seq)
        act = activation_estimate(
            vconfig,
            micro_batch,
            seq,
            recompute_coupling=vconfig.attention.recompute_coupling,
            sdpa_kernel=sdpa_kernel_for(work.attention["kernels"]),
        )
        layers = vconfig.model.num_layers
        estimate = layers * act.layer_bytes + act.embedding_bytes + act.output_bytes
        utilisation = mfu(tokens_per_s, vconfig, peak, seq_length=seq)
    return {
        "variant": work.variant,
        "coupling_impl": vconfig.attention.coupling_impl,
        "recompute_coupling": vconfig.attention.recompute_coupling,
        "differential_kernel": work.attention["differential_kernel"],
        "sdpa_kernels": work.attention["kernels"],
        "parameters": work.parameters,
        "step_ms": 1000 * median,
        "step_ms_all": [1000 * t for t in work.times],
        "tokens_per_s": tokens_per_s,
        "ratio": ratio,
        "gflop_per_token": flops / 1e9,
        "mfu": utilisation,
        "activation_mib": work.activation_bytes / MIB,
        "activation_estimate_mib": None if estimate is None else estimate / MIB,
        "step_peak_mib": max(work.step_bytes) / MIB if work.step_bytes else None,
    }


def run_benchmark(
    config: RunConfig,
    variants: list[str],
    rounds: int = 5,
    warmup: int = 1,
    micro_batch: int | None = None,
    attention_only: bool = False,
    optimizer: str = "none",
    device: torch.device | None = None,
    clock: str = "wall",
    log: Callable[[str], None] = lambda line: None,
) -> dict:
    """Interleaved timing of ``variants``; returns ``{"meta": ..., "rows": [...]}``.

    ``clock="cpu"`` times with the process's CPU time (CPU only: on a machine shared
    with other jobs it counts the work done, not the waiting for a core).
    """
    if rounds < 1 or warmup < 0:
        raise ValueError("need at least 1 round and a non-negative warm-up")
    if clock not in CLOCKS:
        raise ValueError(f"clock {clock!r}: choose one of {list(CLOCKS)}")
    device = device or init_world(config)
    if clock == "cpu" and device.type == "cuda":
        raise ValueError("clock=cpu measures host CPU time; use the wall clock on GPU")
    micro_batch = micro_batch or config.train.micro_batch_size
    works = build_workloads(config, variants, micro_batch, device, attention_only, optimizer, log)
    time_rounds(works, device, rounds, warmup, clock, log)
    baseline = next((w for w in works if split_variant(w.variant)[0] == "standard"), works[0])
    peak = peak_flops() if device.type == "cuda" else None
    seq = config.model.seq_length
    rows = [result_row(w, baseline, micro_batch, seq, attention_only, peak) for w in works]
    meta = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "precision": config.train.precision,
        "layers": config.model.num_layers,
        "hidden": config.model.hidden_size,
        "heads": config.model.num_attention_heads,
        "kv_heads": config.model.kv_heads,
        "micro_batch": micro_batch,
        "seq": seq,
        "rounds": rounds,
        "warmup": warmup,
        "attention_only": attention_only,
        "optimizer": optimizer,
        "clock": clock,
        "baseline": baseline.variant,
        "peak_flops": peak,
    }
    return {"meta": meta, "rows": rows}


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_report(result: dict) -> str:
    meta, rows = result["meta"], result["rows"]
    what = "one attention layer" if meta["attention_only"] else f"{meta['layers']} layers"
    step = "forward+backward" + ("+AdamW" if meta["optimizer"] == "adamw" else "")
    lines = [
        f"{what}, hidden {meta['hidden']}, {meta['heads']} heads ({meta['kv_heads']} kv), "
        f"micro-batch {meta['micro_batch']} x seq {meta['seq']}, {meta['precision']} on "
        f"{meta['device']} ({meta['threads']} threads); {step}, {meta['rounds']} interleaved "
        f"rounds after {meta['warmup']} warm-up; {meta['clock']} clock",
        f"{'variant':<28}{'step ms':>10}{'tokens/s':>11}{'ratio':>8}{'GFLOP/tok':>11}"
        f"{'MFU':>7}{'act MiB':>9}{'est MiB':>9}{'step MiB':>10}  attention",
    ]
    for row in rows:
        kernels = "+".join(row["sdpa_kernels"]) or "-"
        form = row["differential_kernel"]
        lines.append(
            f"{row['variant']:<28}{row['step_ms']:>10.1f}{row['tokens_per_s']:>11.0f}"
            f"{row['ratio']:>8.3f}{row['gflop_per_token']:>11.3f}"
            f"{_cell(row['mfu'] and 100 * row['mfu'], '.1f'):>7}"
            f"{row['activation_mib']:>9.1f}{_cell(row['activation_estimate_mib'], '.1f'):>9}"
            f"{_cell(row['step_peak_mib'], '.0f'):>10}  {f'{form}:{kernels}' if form else kernels}"
        )
    lines.append(
        f"ratio: median over rounds of step time / {meta['baseline']}'s in the same round; "
        "MFU (%): model FLOPs (3 x forward matmuls) over the GPU's dense bf16 peak"
    )
    lines.append(
        "act MiB: saved-tensor bytes of one forward (measured); est MiB: the planner's "
        "estimate; step MiB (GPU): max_memory_allocated during a step above its start"
    )
    lines.append(
        "attention: differential form (paired/split) and the kernels its attention ran on "
        "(flash, cudnn, efficient, math: SDPA's; maps: paired_maps; te: Transformer Engine)"
    )
    return "\n".join(lines)


def write_json(result: dict, path: str) -> None:
    """Write atomically: a temporary file in the same folder, renamed at the end."""
    write_text_atomically(path, json.dumps(result, indent=2))

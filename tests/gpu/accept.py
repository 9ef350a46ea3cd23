"""GPU acceptance: a cluster user's path, on one H100/H200, in one command, in < 8 minutes.

    python tests/gpu/accept.py [--out DIR] [--work DIR] [--only STAGE,...] [--dry-run]
        [--allow-cpu]

Stages, each with a time budget (``STAGES``; the whole command stays under 8 minutes):

1. ``env``: torch, CUDA, the GPU and its dense bf16 peak, megatron-core and DeepSpeed.
2. ``data``: the data tools make a small indexed dataset and its tokenizer
   (``python -m data_tools.demo_corpus``).
3. ``train``: ``python -m cqk_megatron.train`` (what ``cqk train`` runs) in bf16 on that
   dataset, for standard, coupled and differential attention and the GPT-2 family's
   coupled model, under DeepSpeed ZeRO-1 and under ``train.engine=megatron``,
   concurrently on the one GPU, with the replica check on; the coupled ZeRO-1 run again,
   stopped by SIGTERM mid-run (it must save and exit 75) and resumed (exit 0); and a
   ZeRO-3 run that saves mid-run, beside its twin that stops after that save and resumes.
   Each run must learn, report MFU and memory; both engines must start from the same loss
   and stay together over every step; each resumed run must follow its uninterrupted twin.
4. ``export``: ``cqk convert export`` of a checkpoint written on the GPU; the Hugging Face
   model's logits on the GPU against the Megatron model's (fp32, TF32 off).
5. ``kernels``: which SDPA kernel each attention variant ran (``KERNEL_VARIANTS``), read
   off the profiler: flash or cuDNN, not the math path, for ``FUSED_REQUIRED``.
6. ``bench``: ``cqk_megatron.bench.variants`` at 350M and 1B: tokens/s, MFU, step-time
   ratios to standard (at 350M checked: ``RATIO_LIMITS``), activation memory against the
   planner.
7. ``speed``: ``configs/runs/1b_4x8.yaml`` itself (the Megatron engine, its distributed
   optimizer, ``overlap_grad_reduce``, bf16, its micro-batch) trained by ``cqk train`` on
   one GPU, layers cut: MFU at least ``MFU_OF_PREDICTION`` of the step-time model's for that
   cut config on this GPU (``GPU_PROFILES``) and at least ``MFU_FLOOR``; peak memory within
   ``MEMORY_TOLERANCE`` of the planner's.
8. ``multigpu``: with two GPUs (NCCL), TP=2 + SP and interleaved PP=2 under the Megatron
   engine, from the same weights as a one-GPU run, whose losses they must follow within
   the CPU layout tests' bf16 tolerance; with fewer GPUs it is skipped, saying why.

Prints one table and writes one JSON (``$OUT/accept.json`` if ``OUT`` is set, else
``--out`` or ``./gpu_accept.json``) with a log of failures beside it (``accept.log``).
Exit status 0 if every check passed, 1 if one failed, 2 if it cannot run (no GPU).
``--dry-run`` prints the stages, their budgets and what each will run, without a GPU (CI
runs it). The machine needs Python 3.12 and torch; megatron-core and DeepSpeed can come as
wheels (``tests/gpu/prepare_wheels.sh``, ``docs/gpu.md``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from cqk_megatron.cli.quiet import quiet_third_party_warnings  # noqa: E402  (after the path)

quiet_third_party_warnings()  # as every cqk command: CQK_VERBOSE=1 shows them

TOTAL_BUDGET_S = 480  # 8 minutes on one H100/H200


@dataclass(frozen=True)
class Stage:
    name: str
    budget_s: int
    what: str


STAGES = (
    Stage("env", 20, "torch, CUDA, GPU name and peak, megatron-core and DeepSpeed versions"),
    Stage("data", 40, "data tools: corpus -> SentencePiece tokenizer -> indexed .bin/.idx"),
    Stage(
        "train",
        150,
        "cqk train bf16: {standard, coupled, differential, coupled GPT-2} x {DeepSpeed "
        "ZeRO-1, Megatron distributed optimizer}, concurrently, replica check on; engines "
        "compared over every step; coupled ZeRO-1 SIGTERM mid-run, resumed; ZeRO-3 saving "
        "mid-run, its twin resumed from that save",
    ),
    Stage("export", 40, "cqk convert export of a GPU checkpoint; HF vs Megatron logits on GPU"),
    Stage("kernels", 30, "the SDPA kernel each variant runs (profiler): flash/cuDNN, not math"),
    Stage(
        "bench",
        85,
        "cqk bench 350M and 1B: tokens/s, MFU, ratios (350M: coupled <= 1.10, differential "
        "<= 1.25 x standard), memory vs planner",
    ),
    Stage(
        "speed",
        70,
        "cqk train of configs/runs/1b_4x8.yaml on one GPU, layers cut (its engine, "
        "distributed optimizer, overlap_grad_reduce, bf16): MFU >= 80% of the step-time "
        "model's and >= 35%, peak memory within 10% of the planner's",
    ),
    Stage(
        "multigpu",
        40,
        "two GPUs (NCCL), Megatron engine, bf16: TP=2 + SP and interleaved PP=2 against "
        "one GPU from the same weights; skipped, saying so, with fewer GPUs",
    ),
)

# The variants whose SDPA kernels are checked, one list (bench's variant syntax:
# differential@paired / @split are the two forms of differential attention's scoring).
KERNEL_VARIANTS = (
    "standard",
    "coupled",
    "differential",
    "coupled_differential",
    "differential@paired",
    "differential@split",
)
FUSED_REQUIRED = ("standard", "coupled", "differential@split")  # flash or cuDNN, or FAIL
FUSED_KERNELS = ("flash", "cudnn")
TRAIN_VARIANTS = ("standard", "coupled", "differential")
GPT2 = "coupled-gpt2"  # the GPT-2 family (biases, LayerNorm, GELU) with coupled attention
ENGINES = {
    "deepspeed": ["train.engine=deepspeed", "train.zero_stage=1"],
    "megatron": ["train.engine=megatron"],
}
RESUMED = "coupled-deepspeed"  # its twin is stopped by SIGTERM and resumed
ZERO3 = "coupled-zero3"  # ZeRO-3 (parameters partitioned) saving mid-run
# a twin of each: stopped mid-run (SIGTERM, or train.resilience.exit_after_steps at the mid-run
# save), then run again with the same command less that stop, to resume from the checkpoint
TWINS = {f"{RESUMED}-resumed": RESUMED, f"{ZERO3}-resumed": ZERO3}
REPLICA_CHECK_INTERVAL = 10  # steps; on one GPU it runs the check's code, compares nothing
# bf16 on a GPU: the two engines sum in different orders (and flash backward is not bitwise
# deterministic), so their losses drift apart by rounding; a real difference (a missing
# gradient sum, an optimizer setting) shows as a gap of 1e-1 or more within 50 steps
ENGINE_GAP = 2e-2
BENCH = (("configs/models/350m.yaml", 8), ("configs/models/1b.yaml", 4))
BENCH_VARIANTS = ("standard", "coupled", "differential")
BENCH_SEQ = 2048
ACTIVATION_ESTIMATE_RANGE = (0.75, 1.33)  # measured / planner, saved-tensor bytes
# Step time over standard attention's at 350M that a GPU must not exceed (the coupling
# compiled, differential attention in its paired form); at 1B the ratios are reported.
RATIO_SIZE = "350m"
RATIO_LIMITS = {"coupled": 1.10, "differential": 1.25}


def ratio_check(label: str, variant: str, ratio: float | None, on_gpu: bool):
    """(expected, verdict) of a variant's step-time ratio to standard: checked on a GPU at
    ``RATIO_SIZE`` for the variants of ``RATIO_LIMITS``, else reported (verdict None)."""
    limit = RATIO_LIMITS.get(variant) if label == RATIO_SIZE else None
    if limit is None:
        return "reported", None
    return f"<= {limit}", (ratio is not None and ratio <= limit) if on_gpu else None


@dataclass
class Sizes:
    """What the stages run; ``--allow-cpu`` shrinks them for a smoke run."""

    corpus_mb: float = 2.0
    vocab: int = 4096
    model: tuple[str, ...] = (
        "model.num_layers=4",
        "model.hidden_size=256",
        "model.num_attention_heads=4",
        "model.seq_length=512",
    )
    precision: str = "bf16"
    steps: int = 40
    micro_batch: int = 8
    global_batch: int = 16
    signal_at_step: int = 5
    bench: tuple[tuple[str, int], ...] = BENCH
    bench_seq: int = BENCH_SEQ
    bench_rounds: int = 3
    bench_warmup: int = 2
    kernel_model: tuple[str, ...] = (
        "model.hidden_size=2048",
        "model.num_attention_heads=16",
        "model.num_query_groups=8",
        "model.seq_length=1024",
    )
    # the 1B run on one GPU: its layers cut (8 of 16: 20 GiB by the planner, a 0.23 s step
    # by the step-time model on an H100), everything else the run's own
    speed_model: tuple[str, ...] = ("model.num_layers=8",)
    speed_steps: int = 25
    two_gpu_steps: int = 10  # the CPU layout tests' curve length (tests/_curves.py)


def cpu_sizes() -> Sizes:
    return Sizes(
        corpus_mb=0.3,
        vocab=1024,
        model=(
            "model.num_layers=2",
            "model.hidden_size=64",
            "model.num_attention_heads=4",
            "model.seq_length=64",
        ),
        precision="fp32",
        steps=24,
        micro_batch=4,
        global_batch=8,
        signal_at_step=3,
        bench=(("tiny", 2),),
        bench_seq=128,
        bench_rounds=2,
        bench_warmup=1,
        kernel_model=(
            "model.hidden_size=256",
            "model.num_attention_heads=4",
            "model.seq_length=128",
        ),
        speed_model=(
            "model.num_layers=1",
            "model.hidden_size=128",
            "model.num_attention_heads=4",
            "model.ffn_hidden_size=256",
            "model.seq_length=128",
            "model.vocab_size=1024",
        ),
        speed_steps=8,
        two_gpu_steps=4,
    )


# -- the 1B run's settings on one GPU, and the layouts on two -----------------------------

RUN_1B = "configs/runs/1b_4x8.yaml"
# The one-GPU hardware profile of the GPU torch reports: its figures from the cluster
# profile of its kind (only compute and HBM matter on one GPU: no link is used).
GPU_PROFILES = {
    "H200": "configs/clusters/example_h200.yaml",
    "H100": "configs/clusters/example_h100.yaml",
}
MFU_OF_PREDICTION = 0.80  # measured MFU over the step-time model's, at least
MFU_FLOOR = 0.35  # measured MFU, at least
MEMORY_TOLERANCE = 0.10  # |measured peak - planner| / planner, at most
SPEED_GLOBAL_BATCH = 16  # 4 micro-batches of the 1B run's 4 sequences: a step of 0.1-0.3 s
SPEED_WARMUP_STEPS = 5  # left out of the MFU: the coupling's compilation, allocator growth
# TP=2 + SP and interleaved PP=2 (2 virtual stages of one layer each, on 4 layers), under
# the 1B run's engine; each from the same TP=1 weights as the one-GPU reference
TWO_GPU_LAYOUTS = {
    "tp2sp": ["parallel.tensor_parallel=2", "parallel.sequence_parallel=true"],
    "pp2vp2": ["parallel.pipeline_parallel=2", "parallel.virtual_pipeline=2"],
}
TWO_GPU_REFERENCE = "one-gpu"
# bf16 tolerances of the CPU layout tests (tests/_curves.py): the whole loss curve, and
# step 1 (same weights and batch: the gradient alone)
TWO_GPU_LOSS_TOLERANCE = 2e-3
TWO_GPU_FIRST_STEP_TOLERANCE = 1e-4


def one_gpu_hardware(device_name: str):
    """The step-time model's hardware for one GPU named ``device_name`` (H100 or H200
    figures from their cluster profiles, one GPU a node), or None for another GPU."""
    from cqk_megatron.planner.hardware import load_hardware

    for kind, profile in GPU_PROFILES.items():
        if kind in device_name:
            return dataclasses.replace(load_hardware(REPO / profile), gpus_per_node=1)
    return None


def speed_overrides(work: Path, sizes: Sizes) -> list[str]:
    """configs/runs/1b_4x8.yaml on one GPU: its layers cut, a few steps on the demo data;
    its engine, optimizer, overlap, precision, micro-batch and parallel sizes kept."""
    data = work / "data"
    return [
        *sizes.speed_model,
        "parallel.world_size=1",
        f"data.prefixes=[{data}/demo_text_document]",
        f"data.tokenizer={data}/tokenizer.model",
        f"data.cache_dir={work}/cache/speed",
        f"train.global_batch_size={SPEED_GLOBAL_BATCH}",
        f"train.train_steps={sizes.speed_steps}",
        "train.schedule.warmup_steps=2",
        f"train.eval_interval={10 * sizes.speed_steps}",
        f"train.checkpoint.save_interval={10 * sizes.speed_steps}",
        "train.checkpoint.hashes=false",
        "name=1b-one-gpu",
        f"log.root={work}/runs",
        "log.wandb_mode=disabled",
        'log.progress_bar="off"',
    ]


def speed_config(work: Path, sizes: Sizes):
    from cqk_megatron.config import load_config, validate

    return validate(load_config(REPO / RUN_1B, speed_overrides(work, sizes)))


def speed_expectations(config, hardware) -> tuple[float, float]:
    """(MFU the step-time model predicts, peak GiB the planner estimates) for ``config``
    on ``hardware``."""
    from cqk_megatron.perf.fit import GIB, own_layout, plan_layout
    from cqk_megatron.planner.step_time import predict_step

    layout = own_layout(config, config.parallel.world_size, None, None)
    plan = plan_layout(config, layout, config.train.micro_batch_size, hardware.hbm_bytes)
    return predict_step(config, hardware).mfu, plan.worst.total / GIB


@dataclass(frozen=True)
class Verdict:
    name: str
    ok: bool
    message: str


def judge_speed(
    mfu: float, predicted_mfu: float, peak_gib: float, planned_gib: float
) -> list[Verdict]:
    """The speed stage's three checks of a measurement against the predictions, each with
    its numbers."""
    share = mfu / predicted_mfu
    gap = abs(peak_gib - planned_gib) / planned_gib
    return [
        Verdict(
            "MFU / step-time model",
            share >= MFU_OF_PREDICTION,
            f"MFU {mfu:.1%} is {share:.0%} of the predicted {predicted_mfu:.1%} "
            f"(at least {MFU_OF_PREDICTION:.0%})",
        ),
        Verdict("MFU", mfu >= MFU_FLOOR, f"MFU {mfu:.1%} (at least {MFU_FLOOR:.0%})"),
        Verdict(
            "peak memory / planner",
            gap <= MEMORY_TOLERANCE,
            f"peak {peak_gib:.2f} GiB, planner {planned_gib:.2f} GiB: {gap:.1%} apart "
            f"(at most {MEMORY_TOLERANCE:.0%})",
        ),
    ]


def two_gpu_skip_reason(gpus: int) -> str | None:
    """Why the two-GPU stage does not run here, or None where it does."""
    if gpus >= 2:
        return None
    return f"skipped: {gpus} GPU(s) here, the stage needs 2"


def two_gpu_runs(work: Path, sizes: Sizes) -> dict[str, list[str]]:
    """Name -> overrides (on configs/runs/demo.yaml): the one-GPU reference and each
    two-GPU layout, all from the TP=1 weights at ``work/init``, under the 1B run's engine."""
    data = work / "data"
    common = [
        *sizes.model,
        "model.num_layers=4",  # one a virtual stage at PP=2 x VP=2
        f"model.vocab_size={sizes.vocab}",
        f"data.prefixes=[{data}/demo_text_document]",
        f"data.tokenizer={data}/tokenizer.model",
        "train.engine=megatron",
        f"train.precision={sizes.precision}",
        f"train.micro_batch_size={sizes.micro_batch}",
        f"train.global_batch_size={sizes.global_batch}",
        f"train.train_steps={sizes.two_gpu_steps}",
        f"train.eval_interval={10 * sizes.two_gpu_steps}",
        f"train.checkpoint.save_interval={10 * sizes.two_gpu_steps}",
        "train.checkpoint.hashes=false",
        f"train.init_from={work}/init",
        f"log.root={work}/runs",
        "log.wandb_mode=disabled",
        'log.progress_bar="off"',
    ]
    layouts = {TWO_GPU_REFERENCE: [], **TWO_GPU_LAYOUTS}
    return {
        name: [*common, *layout, f"name={name}", f"data.cache_dir={work}/cache/{name}"]
        for name, layout in layouts.items()
    }


def judge_curves(losses: list[float], reference: list[float]) -> Verdict:
    """A two-GPU layout's losses against the one-GPU run's: every one finite, the curve
    within the CPU layout tests' bf16 tolerance, step 1 within the tighter one."""
    finite = bool(losses) and all(math.isfinite(x) for x in losses)
    if not (finite and len(losses) == len(reference)):
        return Verdict(
            "loss",
            False,
            f"{len(losses)} losses, finite: {finite}; expected {len(reference)} finite",
        )
    gaps = [abs(x - y) / abs(y) for x, y in zip(losses, reference, strict=True)]
    ok = max(gaps) <= TWO_GPU_LOSS_TOLERANCE and gaps[0] <= TWO_GPU_FIRST_STEP_TOLERANCE
    return Verdict(
        "loss vs one GPU",
        ok,
        f"largest rel. gap {max(gaps):.2e} (at most {TWO_GPU_LOSS_TOLERANCE:g}), step 1 "
        f"{gaps[0]:.2e} (at most {TWO_GPU_FIRST_STEP_TOLERANCE:g})",
    )


# -- checks and the table ------------------------------------------------------------------


@dataclass
class Check:
    stage: str
    name: str
    value: str
    expected: str
    ok: bool | None  # None: reported, not judged

    @property
    def verdict(self) -> str:
        return {True: "PASS", False: "FAIL", None: "info"}[self.ok]


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)
    stages: dict[str, dict] = field(default_factory=dict)
    data: dict = field(default_factory=dict)
    log: list[str] = field(default_factory=list)

    def check(self, stage: str, name: str, value, expected: str, ok: bool | None) -> bool:
        self.checks.append(Check(stage, name, _text(value), expected, ok))
        print(f"  [{stage}] {name}: {_text(value)} ({expected}) {self.checks[-1].verdict}")
        return bool(ok) or ok is None

    @property
    def passed(self) -> bool:
        return all(c.ok is not False for c in self.checks) and all(
            s.get("ok", False) for s in self.stages.values()
        )

    def table(self) -> str:
        widths = (8, 44, 30, 26)
        head = ("stage", "check", "value", "expected")
        lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)) + "  result"]
        for c in self.checks:
            cells = (c.stage, c.name, c.value, c.expected)
            lines.append(
                "  ".join(x[:w].ljust(w) for x, w in zip(cells, widths, strict=True))
                + f"  {c.verdict}"
            )
        for name, stage in self.stages.items():
            lines.append(
                f"{'time':<8}  {name + ' stage':<44}  {stage['seconds']:>6.0f} s{'':<22}  "
                f"<= {stage['budget_s']} s{'':<19}  {'PASS' if stage['ok'] else 'FAIL'}"
            )
        return "\n".join(lines)


def _text(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class StageTimeout(Exception):
    pass


@contextlib.contextmanager
def alarm(seconds: float):
    """Raise ``StageTimeout`` in this (main) thread after ``seconds``."""

    def ring(signum, frame):
        raise StageTimeout(f"over its {seconds:.0f} s budget")

    previous = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# -- the runs ------------------------------------------------------------------------------


def train_runs(work: Path, sizes: Sizes) -> dict[str, list[str]]:
    """Name -> the overrides of each ``cqk train`` run (on top of configs/runs/demo.yaml)."""
    from cqk_megatron.config import VARIANTS, family_overrides

    data = work / "data"
    common = [
        *sizes.model,
        f"model.vocab_size={sizes.vocab}",
        f"data.prefixes=[{data}/demo_text_document]",
        f"data.tokenizer={data}/tokenizer.model",
        f"train.precision={sizes.precision}",
        f"train.micro_batch_size={sizes.micro_batch}",
        f"train.global_batch_size={sizes.global_batch}",
        f"train.train_steps={sizes.steps}",
        "train.optimizer.lr=2e-3",
        "train.schedule.min_lr=2e-4",
        "train.schedule.warmup_steps=4",
        f"train.eval_interval={sizes.steps // 2}",
        "train.eval_iters=2",
        f"train.checkpoint.save_interval={sizes.steps // 2}",
        "train.checkpoint.hashes=false",
        f"train.resilience.check_replicas_interval={REPLICA_CHECK_INTERVAL}",
        f"log.root={work}/runs",
        "log.wandb_mode=disabled",
        'log.progress_bar="off"',
    ]
    runs = {}

    def add(name: str, *overrides: str) -> None:
        # each process builds its own index
        runs[name] = [*overrides, f"name={name}", f"data.cache_dir={work}/cache/{name}"]

    def variant(name: str) -> list[str]:
        coupling, scoring = VARIANTS[name]
        return [f"attention.coupling={coupling}", f"attention.scoring={scoring}"]

    for engine, engine_overrides in ENGINES.items():
        for name in TRAIN_VARIANTS:
            add(f"{name}-{engine}", *common, *engine_overrides, *variant(name))
        gpt2 = family_overrides("gpt2")
        add(f"{GPT2}-{engine}", *common, *engine_overrides, *gpt2, *variant("coupled"))
    add(ZERO3, *common, "train.engine=deepspeed", "train.zero_stage=3", *variant("coupled"))
    for twin, original in TWINS.items():
        stop = (
            [f"train.resilience.exit_after_steps={sizes.steps // 2}"] if original == ZERO3 else []
        )
        add(twin, *settings(runs[original]), *stop)
    return runs


def settings(overrides: list[str]) -> list[str]:
    """A run's overrides less its name and index cache: what its twin repeats."""
    return [o for o in overrides if not o.startswith(("name=", "data.cache_dir="))]


def resumed_command(overrides: list[str]) -> list[str]:
    """The twin's second launch: the same command less the stop it was given."""
    return [o for o in overrides if not o.startswith("train.resilience.exit_after_steps=")]


def train_command(overrides: list[str], run: str = "configs/runs/demo.yaml") -> list[str]:
    config = str(REPO / run)
    return [sys.executable, "-m", "cqk_megatron.train", "--config", config, *overrides]


def child_env(port: int, on_gpu: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(
        PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
        PYTHONUNBUFFERED="1",
        PYTHONWARNINGS="ignore",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        DS_ACCELERATOR="cuda" if on_gpu else "cpu",
        OMP_NUM_THREADS="2",
        # deterministic cuBLAS, so that the resumed run can be compared closely
        CUBLAS_WORKSPACE_CONFIG=":4096:8",
    )
    return env


def metrics(run_dir: Path, kind: str) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            rows.append(json.loads(line))
    return [r for r in rows if r.get("kind") == kind]


def variant_kernels(config, variant: str, micro_batch: int, here) -> dict:
    """Build ``variant``'s attention layer, warm it up (forward + backward: kernel choice,
    cuDNN plans), then ``cqk_megatron.bench.variants.attention_kernels``: the differential
    form it took and the kernels one profiled forward ran (SDPA's ``flash``, ``cudnn``,
    ``efficient``, ``math``; ``maps`` or ``te`` where differential attention runs its own).
    The backward runs on the forward's SDPA kernel."""
    import torch

    from cqk_megatron.bench.variants import attention_kernels, build_workload

    work = build_workload(config, variant, micro_batch, here, attention_only=True)
    work.step()
    if here.type == "cuda":
        torch.cuda.synchronize(here)
    found = attention_kernels(work.module, work.forward)
    del work
    return found


# -- the command ---------------------------------------------------------------------------


class Acceptance:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        self.args = args
        self.on_gpu = torch.cuda.is_available()
        self.sizes = Sizes() if self.on_gpu else cpu_sizes()
        self.work = Path(args.work or tempfile.mkdtemp(prefix="cqk-accept-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.report = Report()
        # a CPU smoke run keeps the stages' proportions, not their seconds
        self.scale = 1.0 if self.on_gpu else args.cpu_budget_scale

    # -- stages ----------------------------------------------------------------------

    def env(self, budget: float) -> None:
        import torch

        report = self.report
        name = torch.cuda.get_device_name() if self.on_gpu else "cpu"
        report.data["device"] = name
        version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
        report.check("env", "torch", torch.__version__, ">= 2.5", version >= (2, 5))
        report.check("env", "CUDA", str(torch.version.cuda), "a CUDA build", self.on_gpu or None)
        report.check(
            "env", "device", name, "an H100 or H200", ("H100" in name or "H200" in name) or None
        )
        from cqk_megatron.perf.flops import peak_flops

        peak = peak_flops(name) if self.on_gpu else None
        report.check(
            "env",
            "dense bf16 peak (FLOP/s)",
            peak,
            "known (for MFU)",
            peak is not None if self.on_gpu else None,
        )
        import megatron.core

        version = getattr(megatron.core, "__version__", "?")
        report.check("env", "megatron-core", version, "0.16.1", version == "0.16.1")
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if self.on_gpu else "cpu")
        import deepspeed

        report.check("env", "deepspeed", deepspeed.__version__, "importable", True)
        report.check("env", "python", sys.version.split()[0], "3.10+", sys.version_info >= (3, 10))

    def data(self, budget: float) -> None:
        out = self.work / "data"
        command = [
            sys.executable,
            "-m",
            "data_tools.demo_corpus",
            "--output",
            str(out),
            "--max-mb",
            str(self.sizes.corpus_mb),
            "--vocab-size",
            str(self.sizes.vocab),
            "--quiet",
        ]
        code, log = self._run_logged("data", command, child_env(29590, self.on_gpu), budget)
        self.report.check("data", "data_tools.demo_corpus exit", code, "0", code == 0)
        meta = out / "demo_text_document.meta.json"
        ok = (out / "demo_text_document.bin").is_file() and (out / "tokenizer.model").is_file()
        tokens = json.loads(meta.read_text()).get("num_tokens") if meta.is_file() else None
        self.report.check("data", "indexed dataset + tokenizer", tokens or ok, "written", ok)

    def train(self, budget: float) -> None:
        deadline = time.monotonic() + budget
        runs = train_runs(self.work, self.sizes)
        jobs = {}
        for index, (name, overrides) in enumerate(runs.items()):
            jobs[name] = self._start(name, overrides, 29600 + 10 * index)
        signalled = f"{RESUMED}-resumed"  # the other twin stops itself (exit_after_steps)
        exits: dict[str, list[int]] = {name: [] for name in runs}
        try:
            while jobs and time.monotonic() < deadline:
                time.sleep(0.05)
                for name, process in list(jobs.items()):
                    if name == signalled and not exits[name]:
                        self._signal_after_a_step(name, process)
                    code = process.poll()
                    if code is None:
                        continue
                    exits[name].append(code)
                    del jobs[name]
                    if name in TWINS and len(exits[name]) == 1 and code == 75:
                        port = 29600 + 10 * (len(runs) + list(TWINS).index(name))
                        command = resumed_command(runs[name])
                        jobs[name] = self._start(name, command, port, append=True)
        finally:
            for name, process in jobs.items():  # over budget: no process is left behind
                process.kill()
                process.wait()
                exits[name].append(-9)
        self.report.data["train_exits"] = exits
        self._check_runs(runs, exits)

    def _signal_after_a_step(self, name: str, process: subprocess.Popen) -> None:
        if "signalled_after_step" in self.report.data:
            return
        logged = metrics(self.work / "runs" / name, "train")
        if logged and logged[-1]["step"] >= self.sizes.signal_at_step:
            process.send_signal(signal.SIGTERM)
            self.report.data["signalled_after_step"] = logged[-1]["step"]

    def _start(self, name: str, overrides: list[str], port: int, append: bool = False):
        (self.work / "logs").mkdir(exist_ok=True)
        log = (self.work / "logs" / f"{name}.log").open("a" if append else "w")
        return subprocess.Popen(
            train_command(overrides),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=child_env(port, self.on_gpu),
            cwd=REPO,
        )

    def _check_runs(self, runs: dict, exits: dict) -> None:
        report, steps = self.report, self.sizes.steps
        curves = {}
        for name in runs:
            run_dir = self.work / "runs" / name
            expected = [75, 0] if name in TWINS else [0]
            ok = report.check(
                "train", f"{name} exit codes", exits[name], str(expected), exits[name] == expected
            )
            train = metrics(run_dir, "train")
            curves[name] = [r["loss"] for r in train]
            if not ok:
                self._tail(name)
                continue
            losses = curves[name]
            finite = len(losses) == steps and all(math.isfinite(x) for x in losses)
            report.check("train", f"{name} steps logged", len(losses), f"{steps}, finite", finite)
            if finite:
                first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
                report.check(
                    "train",
                    f"{name} loss first -> last",
                    f"{first:.3f} -> {last:.3f}",
                    "falls by > 0.5",
                    last < first - 0.5,
                )
            mfu = [r["mfu"] for r in train if r.get("mfu") is not None]
            report.check(
                "train",
                f"{name} MFU (last step)",
                mfu[-1] if mfu else None,
                "reported on GPU",
                bool(mfu) if self.on_gpu else None,
            )
            memory = [r["mem_gb"] for r in train]
            report.check(
                "train",
                f"{name} peak memory GB",
                max(memory) if memory else None,
                "reported",
                bool(memory),
            )
            final = [v for v in metrics(run_dir, "valid") if v.get("final")]
            report.check(
                "train",
                f"{name} final validation",
                final[-1]["val_loss"] if final else None,
                "written",
                bool(final),
            )
        report.data["train_losses"] = curves
        for variant in (*TRAIN_VARIANTS, GPT2):
            self._check_engines_agree(variant, curves)
        for twin, original in TWINS.items():
            self._check_twin(twin, curves.get(original), curves.get(twin))

    def _check_engines_agree(self, variant: str, curves: dict) -> None:
        """Same weights and batches: the same step-1 loss; then the same curve, to bf16's
        rounding, over every step."""
        a, b = curves.get(f"{variant}-deepspeed"), curves.get(f"{variant}-megatron")
        if not (a and b and len(a) == len(b)):
            return
        gap = abs(a[0] - b[0]) / abs(b[0])
        self.report.check(
            "train",
            f"{variant}: step-1 loss, ZeRO-1 vs Megatron",
            gap,
            "<= 1e-3 (same weights)",
            gap <= 1e-3,
        )
        worst = max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))
        self.report.check(
            "train",
            f"{variant}: every step, ZeRO-1 vs Megatron",
            worst,
            f"<= {ENGINE_GAP:g} (bf16 rounding)",
            worst <= ENGINE_GAP,
        )

    def _check_twin(self, twin: str, straight: list | None, stopped: list | None) -> None:
        steps, report = self.sizes.steps, self.report
        if not (straight and stopped and len(straight) == len(stopped) == steps):
            return
        logged = [r["step"] for r in metrics(self.work / "runs" / twin, "train")]
        once = logged == list(range(1, steps + 1))
        report.check("train", f"{twin}: steps 1..N once each", once, "True", once)
        gaps = [abs(x - y) / abs(y) for x, y in zip(stopped, straight, strict=True)]
        report.data[f"{twin}_gaps"] = gaps
        # bf16 kernels (flash backward's atomics) are not bitwise deterministic on GPU
        report.check(
            "train",
            f"{twin} vs uninterrupted loss (max rel.)",
            max(gaps),
            "<= 2e-2 (bf16, GPU)",
            max(gaps) <= 2e-2,
        )

    def export(self, budget: float) -> None:
        import torch

        run = self.work / "runs" / "coupled-megatron"
        folder = run / "checkpoints" / f"iter_{self.sizes.steps:07d}"
        hf = self.work / "hf"
        command = [
            sys.executable,
            "-m",
            "cqk_megatron",
            "convert",
            "export",
            str(folder),
            str(hf),
            "--tokenizer",
            str(self.work / "data" / "tokenizer.model"),
            "--overwrite",
        ]
        code, _ = self._run_logged("export", command, child_env(29580, self.on_gpu), budget)
        if not self.report.check("export", "cqk convert export exit", code, "0", code == 0):
            return
        from transformers import AutoModelForCausalLM

        from cqk_megatron.config import load_config
        from cqk_megatron.model.gpt import build_model
        from cqk_megatron.parallel.device import device, to_device
        from cqk_megatron.parallel.process_groups import init_single_process
        from cqk_megatron.training import checkpoint

        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        config = load_config(folder / "config.yaml", ["train.precision=fp32"])
        init_single_process(config)
        model = build_model(config).eval()
        checkpoint.load_model_weights(folder, model)  # bf16 on disk, fp32 here
        hf_model = AutoModelForCausalLM.from_pretrained(
            hf, trust_remote_code=True, dtype=torch.float32
        )
        hf_model = hf_model.to(device()).eval()
        generator = torch.Generator().manual_seed(0)
        seq = min(256, config.model.seq_length)
        tokens = to_device(torch.randint(0, config.model.vocab_size, (2, seq), generator=generator))
        positions = to_device(torch.arange(seq).expand(2, seq))
        with torch.no_grad():
            expected = model(tokens, positions, None).float()
            actual = hf_model(tokens).logits.float()
        width = min(expected.shape[-1], actual.shape[-1])
        expected, actual = expected[..., :width], actual[..., :width]
        gap = ((actual - expected).abs().max() / expected.abs().max()).item()
        self.report.check(
            "export", "HF vs Megatron logits (max rel., fp32)", gap, "<= 1e-3", gap <= 1e-3
        )
        same = (actual.argmax(-1) == expected.argmax(-1)).float().mean().item()
        self.report.check("export", "same next-token argmax", same, ">= 0.999", same >= 0.999)
        self.report.check(
            "export", "models on", str(actual.device), str(device()), actual.device == device()
        )

    def kernels(self, budget: float) -> None:
        import torch

        from cqk_megatron.bench.variants import init_world, load_bench_config, split_variant

        overrides = [*self.sizes.kernel_model, f"train.precision={self.sizes.precision}"]
        config = load_bench_config("tiny", overrides)
        here = init_world(config)
        found = {}
        for variant in KERNEL_VARIANTS:
            required = variant in FUSED_REQUIRED
            try:
                split_variant(variant)
            except ValueError as error:
                self.report.check(
                    "kernels",
                    variant,
                    f"not in cqk bench here ({error})",
                    "a bench variant",
                    False if required else None,
                )
                continue
            found[variant] = variant_kernels(config, variant, 2, here)
            kernels = found[variant]["kernels"]
            fused = bool(kernels) and set(kernels) <= set(FUSED_KERNELS)
            form = found[variant]["differential_kernel"]
            label = f"{variant} kernels" + (f" ({form} form)" if form else "")
            expected = "flash/cudnn only" if required else "reported"
            judged = fused if (required and self.on_gpu) else None
            self.report.check("kernels", label, "+".join(kernels) or "none", expected, judged)
        self.report.data["attention_kernels"] = found
        if self.on_gpu:
            torch.cuda.empty_cache()

    def bench(self, budget: float) -> None:
        import torch

        from cqk_megatron.bench.variants import (
            format_report,
            init_world,
            load_bench_config,
            run_benchmark,
        )

        results = []
        for spec, micro_batch in self.sizes.bench:
            path = spec if spec == "tiny" else str(REPO / spec)
            config = load_bench_config(
                path,
                [
                    f"model.seq_length={self.sizes.bench_seq}",
                    f"train.precision={self.sizes.precision}",
                ],
            )
            here = init_world(config)
            result = run_benchmark(
                config,
                list(BENCH_VARIANTS),
                rounds=self.sizes.bench_rounds,
                warmup=self.sizes.bench_warmup,
                micro_batch=micro_batch,
                optimizer="adamw",
                device=here,
            )
            result["meta"]["config"] = spec
            results.append(result)
            print(format_report(result), flush=True)
            label = Path(spec).stem
            for row in result["rows"]:
                variant = row["variant"]
                self.report.check(
                    "bench", f"{label} {variant} tokens/s", row["tokens_per_s"], "reported", None
                )
                mfu = row["mfu"]
                self.report.check(
                    "bench",
                    f"{label} {variant} MFU",
                    mfu,
                    "reported on GPU",
                    (mfu is not None and mfu > 0) if self.on_gpu else None,
                )
                if variant != "standard":
                    expected, verdict = ratio_check(label, variant, row["ratio"], self.on_gpu)
                    self.report.check(
                        "bench",
                        f"{label} {variant}/standard step time",
                        row["ratio"],
                        expected,
                        verdict,
                    )
                measured, estimate = row["activation_mib"], row["activation_estimate_mib"]
                if estimate:
                    ratio = measured / estimate
                    low, high = ACTIVATION_ESTIMATE_RANGE
                    self.report.check(
                        "bench",
                        f"{label} {variant} activations / planner",
                        ratio,
                        f"{low}-{high}",
                        low <= ratio <= high,
                    )
                if row["step_peak_mib"] is not None:
                    self.report.check(
                        "bench",
                        f"{label} {variant} step peak MiB",
                        row["step_peak_mib"],
                        "reported",
                        None,
                    )
            if self.on_gpu:
                torch.cuda.empty_cache()
        self.report.data["bench"] = results

    def speed(self, budget: float) -> None:
        import torch

        report, config = self.report, speed_config(self.work, self.sizes)
        t = config.train
        report.check(
            "speed",
            "the 1B run on one GPU",
            f"{config.model.num_layers} layers, {t.engine}, overlap {t.overlap_grad_reduce}, "
            f"{t.precision}",
            "reported",
            None,
        )
        command = train_command(speed_overrides(self.work, self.sizes), RUN_1B)
        code, _ = self._run_logged("speed", command, child_env(29570, self.on_gpu), budget)
        if not report.check("speed", "cqk train exit", code, "0", code == 0):
            return
        train = metrics(self.work / "runs" / config.name, "train")
        measured = [r["mfu"] for r in train[SPEED_WARMUP_STEPS:] if r.get("mfu") is not None]
        memory = [r["mem_gb"] for r in train if r.get("mem_gb") is not None]
        name = torch.cuda.get_device_name() if self.on_gpu else "cpu"
        hardware = one_gpu_hardware(name)
        if not (measured and memory and hardware):
            found = f"MFU of {len(measured)} steps, memory of {len(memory)}, device {name}"
            report.check("speed", "measured", found, "H100/H200, MFU and memory", None)
            return
        predicted, planned = speed_expectations(config, hardware)
        mfu, peak = statistics.median(measured), max(memory)
        report.data["speed"] = {"mfu": mfu, "predicted_mfu": predicted, "peak_gib": peak}
        report.data["speed"]["planned_gib"] = planned
        for verdict in judge_speed(mfu, predicted, peak, planned):
            report.check("speed", verdict.name, verdict.message, "see value", verdict.ok)

    def multigpu(self, budget: float) -> None:
        import torch

        gpus = torch.cuda.device_count() if self.on_gpu else 0
        reason = two_gpu_skip_reason(gpus)
        label = "TP=2 + SP and interleaved PP=2"
        if reason:
            self.report.check("multigpu", label, reason, "runs on 2 GPUs", None)
            return
        deadline = time.monotonic() + budget
        runs = two_gpu_runs(self.work, self.sizes)
        self._save_initial_weights(runs[TWO_GPU_REFERENCE])
        jobs = []
        for index, (name, overrides) in enumerate(runs.items()):
            world = 1 if name == TWO_GPU_REFERENCE else 2
            for rank in range(world):
                process = self._start_rank(name, overrides, 29700 + 10 * index, rank, world)
                jobs.append((name, process))
        exits = self._wait_all(jobs, deadline)
        self.report.data["two_gpu_exits"] = exits
        curves = {}
        for name in runs:
            ok = self.report.check(
                "multigpu",
                f"{name} exits",
                exits[name],
                "all 0",
                not any(code != 0 for code in exits[name]),
            )
            curves[name] = [r["loss"] for r in metrics(self.work / "runs" / name, "train")]
            if not ok:
                self._tail(f"{name}-rank0")
        self.report.data["two_gpu_losses"] = curves
        for name in TWO_GPU_LAYOUTS:
            verdict = judge_curves(curves[name], curves[TWO_GPU_REFERENCE])
            self.report.check(
                "multigpu", f"{name}: {verdict.name}", verdict.message, "see value", verdict.ok
            )

    def _save_initial_weights(self, overrides: list[str]) -> None:
        """The TP=1 weights every two-GPU run starts from (``train.init_from``)."""
        import torch

        from cqk_megatron.config import load_config
        from cqk_megatron.model.gpt import build_model
        from cqk_megatron.parallel.process_groups import init_single_process
        from cqk_megatron.training import checkpoint

        settings = [o for o in overrides if not o.startswith("train.init_from=")]
        config = load_config(REPO / "configs/runs/demo.yaml", settings)
        init_single_process(config)
        torch.manual_seed(config.seed)
        checkpoint.save_weights(self.work / "init", build_model(config), config)

    def _start_rank(self, name: str, overrides: list[str], port: int, rank: int, world: int):
        (self.work / "logs").mkdir(exist_ok=True)
        log = (self.work / "logs" / f"{name}-rank{rank}.log").open("w")
        env = child_env(port, self.on_gpu)
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # as the cluster profiles set it
        return subprocess.Popen(
            train_command(overrides), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO
        )

    @staticmethod
    def _wait_all(jobs: list, deadline: float) -> dict[str, list]:
        """Each run's exit codes (one a rank), those still running at ``deadline`` killed."""
        exits: dict[str, list] = {}
        for name, process in jobs:
            try:
                code = process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                code = "timeout"
            exits.setdefault(name, []).append(code)
        return exits

    # -- plumbing --------------------------------------------------------------------

    def _run_logged(self, stage: str, command: list[str], env: dict, timeout: float):
        (self.work / "logs").mkdir(exist_ok=True)
        log_path = self.work / "logs" / f"{stage}.log"
        with log_path.open("w") as log:
            try:
                code = subprocess.run(
                    command,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=REPO,
                    timeout=max(timeout, 1),
                ).returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
        if code != 0:
            self._tail(stage)
        return code, log_path

    def _tail(self, name: str, lines: int = 40) -> None:
        path = self.work / "logs" / f"{name}.log"
        text = path.read_text(errors="replace").splitlines()[-lines:] if path.is_file() else []
        self.report.log += [f"==> {path} (last {lines} lines)", *text]
        print("\n".join(self.report.log[-len(text) - 1 :]), flush=True)

    def run(self, only: list[str]) -> int:
        start = time.monotonic()
        limit = TOTAL_BUDGET_S * self.scale
        for stage in STAGES:
            if only and stage.name not in only:
                continue
            left = limit - (time.monotonic() - start)
            budget = min(stage.budget_s * self.scale, max(left, 1))
            print(f"\n== {stage.name} ({stage.budget_s} s budget): {stage.what}", flush=True)
            began = time.monotonic()
            ok = True
            try:
                with alarm(budget + 5):  # subprocess stages time out on their own first
                    getattr(self, stage.name)(budget)
            except Exception as error:  # report, go on with the next stage
                ok = False
                trace = traceback.format_exc()
                self.report.log += [f"==> stage {stage.name} raised", trace]
                print(trace, flush=True)
                self.report.check(
                    stage.name,
                    "stage ran",
                    f"{type(error).__name__}: {error}"[:200],
                    "no exception",
                    False,
                )
            seconds = time.monotonic() - began
            self.report.stages[stage.name] = {
                "seconds": seconds,
                "budget_s": stage.budget_s * self.scale,
                "ok": ok and seconds <= stage.budget_s * self.scale + 5,
            }
        total = time.monotonic() - start
        self.report.data["total_s"] = total
        print("\n" + self.report.table())
        within = total <= limit
        verdict = "PASS" if self.report.passed and within else "FAIL"
        print(f"total {total:.0f} s of {limit:.0f} s; {verdict}; work folder {self.work}")
        self._write(total, within)
        return 0 if verdict == "PASS" else 1

    def _write(self, total: float, within: bool) -> None:
        out = Path(os.environ.get("OUT") or self.args.out or ".")
        out.mkdir(parents=True, exist_ok=True)
        payload = {
            "passed": self.report.passed and within,
            "on_gpu": self.on_gpu,
            "total_s": total,
            "stages": self.report.stages,
            "checks": [c.__dict__ | {"verdict": c.verdict} for c in self.report.checks],
            **self.report.data,
        }
        name = "accept.json" if os.environ.get("OUT") or self.args.out else "gpu_accept.json"
        (out / name).write_text(json.dumps(payload, indent=1, default=str))
        (out / "accept.log").write_text("\n".join(self.report.log) + "\n")
        print(f"wrote {out / name} and {out / 'accept.log'}")


# -- dry run ---------------------------------------------------------------------------


def dry_run(args: argparse.Namespace) -> int:
    from cqk_megatron.bench.variants import load_bench_config, variant_of
    from cqk_megatron.config import load_config, validate
    from cqk_megatron.model.params import total_parameters
    from cqk_megatron.perf.fit import GIB, Layout, plan_layout

    sizes = Sizes()
    total = sum(stage.budget_s for stage in STAGES)
    print(f"GPU acceptance: {len(STAGES)} stages, {total} s of budgets (limit {TOTAL_BUDGET_S} s)")
    for stage in STAGES:
        print(f"  {stage.name:<8} {stage.budget_s:>4} s  {stage.what}")
    work = Path(args.work or "/tmp/cqk-accept")
    print("\ntrain runs (python -m cqk_megatron.train --config configs/runs/demo.yaml ...):")
    for name, overrides in train_runs(work, sizes).items():
        config = validate(load_config(REPO / "configs/runs/demo.yaml", overrides))
        extra = " (stopped mid-run, then resumed)" if name in TWINS else ""
        print(f"  {name}: {config.attention.variant}, train.engine={config.train.engine}{extra}")
    config = speed_config(work, sizes)
    hardware = one_gpu_hardware("H100")
    predicted, planned = speed_expectations(config, hardware)
    t = config.train
    print(
        f"\nspeed: {RUN_1B} on one GPU, {config.model.num_layers} layers, "
        f"train.engine={t.engine}, overlap_grad_reduce={t.overlap_grad_reduce}, {t.precision}, "
        f"micro-batch {t.micro_batch_size}, {sizes.speed_steps} steps; on an H100 the "
        f"step-time model predicts MFU {predicted:.1%} (pass: >= {MFU_OF_PREDICTION:.0%} of "
        f"it and >= {MFU_FLOOR:.0%}), the planner {planned:.1f} GiB (pass: within "
        f"{MEMORY_TOLERANCE:.0%})"
    )
    print("\ntwo GPUs (skipped with fewer), from the same TP=1 weights:")
    for name, overrides in two_gpu_runs(work, sizes).items():
        p = validate(load_config(REPO / "configs/runs/demo.yaml", overrides)).parallel
        print(
            f"  {name}: TP={p.tensor_parallel} SP={p.sequence_parallel} "
            f"PP={p.pipeline_parallel} VP={p.virtual_pipeline or 1}"
        )
    print(
        f"\nSDPA kernel check: {', '.join(KERNEL_VARIANTS)}; "
        f"flash/cuDNN required for {', '.join(FUSED_REQUIRED)}"
    )
    print(f"\nbenchmark: {', '.join(BENCH_VARIANTS)}, seq {sizes.bench_seq}, bf16, AdamW:")
    for spec, micro_batch in sizes.bench:
        config = load_bench_config(
            str(REPO / spec), [f"model.seq_length={sizes.bench_seq}", "train.precision=bf16"]
        )
        for variant in BENCH_VARIANTS:
            vconfig = variant_of(config, variant)
            plan = plan_layout(vconfig, Layout(1, 1, 1, "ddp"), micro_batch, 80 * GIB)
            act = plan.worst.parts["activations"] / GIB
            print(
                f"  {spec} {variant}: {total_parameters(vconfig):,} parameters, "
                f"micro-batch {micro_batch}, planner activations {act:.1f} GiB"
            )
    return 0 if total <= TOTAL_BUDGET_S else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="folder for accept.json (default: $OUT or .)")
    parser.add_argument("--work", default=None, help="scratch folder (default: a new one in /tmp)")
    parser.add_argument(
        "--only", default="", help=f"comma-separated stages of {[s.name for s in STAGES]}"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print the stages and budgets, run nothing"
    )
    parser.add_argument(
        "--allow-cpu", action="store_true", help="a shrunken smoke run without a GPU"
    )
    parser.add_argument(
        "--cpu-budget-scale", type=float, default=8.0, help="--allow-cpu: budgets times this"
    )
    args = parser.parse_args(argv)
    only = [s for s in args.only.split(",") if s]
    unknown = [s for s in only if s not in {stage.name for stage in STAGES}]
    if unknown:
        parser.error(f"--only: unknown stage(s) {unknown}")
    if args.dry_run:
        return dry_run(args)
    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        print("no CUDA device: run on a GPU machine, or pass --dry-run / --allow-cpu")
        return 2
    return Acceptance(args).run(only)


if __name__ == "__main__":
    sys.exit(main())

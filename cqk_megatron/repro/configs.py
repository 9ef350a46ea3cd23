"""From the command's arguments to one resolved ``RunConfig`` per variant x seed.

Every run of a comparison gets the same preset config, data, data seed, token budget and
schedule; only ``attention.coupling``/``attention.scoring`` (the variant) and ``seed``
differ. Layered, last wins: the preset file, what the runner derives (name, data,
vocabulary, steps from ``--tokens``, warmup, intervals, precision, micro batch), then the
user's ``a.b=c`` overrides, except for the keys the command itself owns.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from cqk_megatron.config import (
    MODEL_FAMILIES,
    ConfigError,
    RunConfig,
    family_overrides,
    load_config,
)
from cqk_megatron.planner.runs import plan_config
from cqk_megatron.repro.data import DataChoice
from cqk_megatron.repro.presets import Preset, ReproError

DATA_SEED = 1234  # the dataset shuffling seed shared by every run (data.seed)

# Keys set by the command's own arguments; an override would break the comparison.
OWNED_KEYS = {
    "name": "the runner names runs PRESET-VARIANT-sSEED",
    "seed": "use --seeds",
    "attention.coupling": "use --variants",
    "attention.scoring": "use --variants",
    "data.prefixes": "use --data",
    "data.tokenizer": "use --tokenizer",
    "train.train_steps": "use --tokens (steps = tokens / (global_batch_size x seq_length))",
    "log.root": "use --out",
    "model.family": "use --family",
}


@dataclass
class ReproRun:
    name: str
    variant: str
    seed: int
    config: RunConfig

    @property
    def run_dir(self) -> Path:
        return Path(self.config.log.root) / self.config.name


@dataclass
class Reproduction:
    preset: Preset
    variants: list[str]
    seeds: list[int]
    tokens_requested: int
    steps: int
    tokens_per_step: int
    data: DataChoice
    out: Path
    nproc: int
    cuda: bool
    runs: list[ReproRun]

    @property
    def tokens(self) -> int:
        return self.steps * self.tokens_per_step


def check_overrides(overrides: list[str]) -> None:
    for override in overrides:
        if "=" not in override:
            raise ReproError(
                f"{override!r} is neither an option nor an override; overrides look like "
                "section.key=value (e.g. train.optimizer.lr=1e-3)"
            )
        key = override.split("=", 1)[0].strip()
        if key in OWNED_KEYS:
            raise ReproError(
                f"override {override!r}: {key} is set by the command; {OWNED_KEYS[key]}"
            )


def _load(preset: Preset, overrides: list[str]) -> RunConfig:
    try:
        return load_config(preset.config, overrides)
    except ConfigError as error:
        raise ReproError(f"preset {preset.name} with the given overrides: {error}") from error


def _micro_batch(config: RunConfig, nproc: int) -> int:
    """The preset's micro batch, lowered until the global batch splits over ``nproc``."""
    p, t = config.parallel, config.train
    if nproc % (p.tensor_parallel * p.pipeline_parallel):
        return t.micro_batch_size  # validate() names the layout problem
    dp = nproc // (p.tensor_parallel * p.pipeline_parallel)
    if t.global_batch_size % dp:
        raise ReproError(
            f"--nproc {nproc}: train.global_batch_size={t.global_batch_size} does not split "
            f"over {dp} data-parallel processes; use an --nproc that divides it"
        )
    per_rank = t.global_batch_size // dp
    return max(m for m in range(1, min(t.micro_batch_size, per_rank) + 1) if per_rank % m == 0)


def build_reproduction(
    preset: Preset,
    variants: list[str],
    seeds: list[int],
    tokens: int,
    data: DataChoice,
    out: Path,
    nproc: int,
    overrides: list[str],
    cuda: bool,
    family: str | None = None,
) -> Reproduction:
    """``family`` (``llama``, ``gpt2``): every run in that model family instead of the
    preset's architecture; its runs are named ``PRESET-FAMILY-VARIANT-sSEED``."""
    if nproc < 1:
        raise ReproError(f"--nproc {nproc} must be at least 1")
    check_overrides(overrides)
    if family is not None:
        if family not in MODEL_FAMILIES:
            raise ReproError(f"--family {family}: choose one of {list(MODEL_FAMILIES)}")
        overrides = [*family_overrides(family), *overrides]
    base = _load(preset, [f"model.vocab_size={data.vocab_size}", *overrides])
    tokens_per_step = base.train.global_batch_size * base.model.seq_length
    steps = max(1, tokens // tokens_per_step)
    user_keys = {o.split("=", 1)[0].strip() for o in overrides}
    derived = {
        "model.vocab_size": data.vocab_size,
        "data.cache_dir": json.dumps(str(out / "index_cache")),  # one index cache: the same samples
        # one data order and one set of validation windows for every seed: --seeds then
        # varies the initialisation only
        "data.seed": DATA_SEED,
        "train.schedule.warmup_steps": max(1, round(preset.warmup_fraction * steps)),
        "train.eval_interval": max(1, steps // preset.evaluations),
        "train.checkpoint.save_interval": max(1, math.ceil(steps / preset.checkpoints)),
        "train.micro_batch_size": _micro_batch(base, nproc),
    }
    if not cuda and base.train.precision == "bf16":
        derived["train.precision"] = "fp32"  # CPU runs are fp32 (bf16 is for GPU kernels)
    runs = []
    for seed in seeds:
        for variant in variants:
            name = f"{preset.name}-{family + '-' if family else ''}{variant}-s{seed}"
            fixed = [
                f"data.prefixes={json.dumps([str(data.prefix)])}",
                f"data.tokenizer={json.dumps(str(data.tokenizer))}",
                f"train.train_steps={steps}",
                f"log.root={json.dumps(str(out / 'runs'))}",
            ]
            chosen = [f"{k}={v}" for k, v in derived.items() if k not in user_keys]
            try:
                config = plan_config(
                    preset.config,
                    variant,
                    name=name,
                    seed=seed,
                    overrides=[*fixed, *chosen, *overrides],
                    world_size=nproc,
                )
            except ConfigError as error:
                raise ReproError(f"run {name}: {error}") from error
            runs.append(ReproRun(name, variant, seed, config))
    return Reproduction(
        preset, variants, seeds, tokens, steps, tokens_per_step, data, out, nproc, cuda, runs
    )

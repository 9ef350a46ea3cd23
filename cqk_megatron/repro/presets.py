"""The presets of ``python -m cqk_megatron.repro`` and the names a variant goes by.

A preset is a config file under ``configs/repro/`` (the model, optimiser and evaluation
settings shared by every run of the comparison) plus what is not a config field: the
default token budget per run, the default variants and seeds, and how the runner turns
a budget into a schedule (warmup as a fraction of the steps, evaluations and checkpoints
per run). docs/repro.md gives the reason for every value.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cqk_megatron.config import CONFIGS_DIR, VARIANTS
from cqk_megatron.variants import ALIASES, preset_of


class ReproError(ValueError):
    """Bad input to the reproduction command; the message names the argument and the fix."""


@dataclass(frozen=True)
class Preset:
    name: str
    config: Path  # the run config shared by every variant
    tokens: int  # default training tokens per run
    variants: tuple[str, ...]
    seeds: tuple[int, ...]
    warmup_fraction: float  # warmup steps = this x train_steps (at least 1)
    evaluations: int  # validation points per run, the final one included
    checkpoints: int  # checkpoints per run: how much a crash can lose
    tokenizer_vocab: int  # vocabulary of the tokenizer trained for a raw-text --data
    description: str


PRESETS: dict[str, Preset] = {
    "paper-60m": Preset(
        name="paper-60m",
        config=CONFIGS_DIR / "repro" / "paper-60m.yaml",
        tokens=1_200_000_000,  # ~20 tokens per parameter (Chinchilla) at 58.5M
        variants=("standard", "coupled", "mlp_only"),
        seeds=(0,),
        warmup_fraction=0.02,
        evaluations=20,
        checkpoints=10,
        tokenizer_vocab=32000,
        description="58.5M parameters (8 x 512), sequence 1024, 65,536 tokens a step, bf16",
    ),
    "paper-150m": Preset(
        name="paper-150m",
        config=CONFIGS_DIR / "repro" / "paper-150m.yaml",
        tokens=2_800_000_000,  # ~20 tokens per parameter at 141M
        variants=("standard", "coupled", "differential"),
        seeds=(0,),
        warmup_fraction=0.02,
        evaluations=20,
        checkpoints=10,
        tokenizer_vocab=32000,
        description="141M parameters (12 x 768), sequence 1024, 131,072 tokens a step, bf16",
    ),
    "cpu-tiny": Preset(
        name="cpu-tiny",
        config=CONFIGS_DIR / "repro" / "cpu-tiny.yaml",
        tokens=614_400,  # 300 steps of 16 x 128 tokens: ~0.55 epoch of the demo corpus
        variants=("standard", "coupled"),
        seeds=(0,),
        warmup_fraction=0.05,
        evaluations=6,
        checkpoints=2,
        tokenizer_vocab=8192,
        description="7.4M parameters (4 x 256, head_dim 64), sequence 128, 2,048 tokens a "
        "step, fp32 in one process",
    ),
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ReproError(
            f"--preset {name!r} is unknown; choose one of {', '.join(PRESETS)} "
            "(cpu-tiny runs in minutes on a CPU, paper-60m/paper-150m want a GPU)"
        )
    return PRESETS[name]


def canonical_variant(name: str) -> str:
    """``hamiltonian`` -> ``coupled``, ``mlp-only`` -> ``mlp_only`` (the registry's aliases,
    ``variants.preset_of``); refuses unknown names."""
    preset = preset_of(name)
    if preset is None:
        known = sorted(set(VARIANTS) | set(ALIASES))
        raise ReproError(f"--variants: {name!r} is not a variant; choose from {', '.join(known)}")
    return preset


def parse_variants(text: str | None, preset: Preset) -> list[str]:
    """The comma-separated ``--variants`` as canonical names, in order, without repeats."""
    if text is None:
        return list(preset.variants)
    names = [part for part in text.split(",") if part.strip()]
    if not names:
        raise ReproError("--variants is empty; give e.g. --variants standard,hamiltonian")
    variants: list[str] = []
    for name in names:
        variant = canonical_variant(name)
        if variant not in variants:
            variants.append(variant)
    return variants


def parse_seeds(text: str | None, preset: Preset) -> list[int]:
    if text is None:
        return list(preset.seeds)
    seeds: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            seed = int(part)
        except ValueError:
            raise ReproError(
                f"--seeds: {part!r} is not an integer; give e.g. --seeds 0,1"
            ) from None
        if seed < 0:
            raise ReproError(f"--seeds: {seed} is negative; seeds are integers >= 0")
        if seed not in seeds:
            seeds.append(seed)
    if not seeds:
        raise ReproError("--seeds is empty; give e.g. --seeds 0,1")
    return seeds


_SUFFIXES = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_tokens(text: str | None, preset: Preset) -> int:
    """``80M``, ``1.2B``, ``614400`` or ``6e5`` -> tokens per run."""
    if text is None:
        return preset.tokens
    raw = text.strip().lower().replace("_", "").replace(",", "")
    scale = 1
    if raw and raw[-1] in _SUFFIXES:
        raw, scale = raw[:-1], _SUFFIXES[raw[-1]]
    try:
        tokens = int(float(raw) * scale)
    except ValueError:
        raise ReproError(
            f"--tokens {text!r} is not a token count; give e.g. --tokens 80M or --tokens 614400"
        ) from None
    if tokens <= 0:
        raise ReproError(f"--tokens {text!r} must be positive")
    return tokens

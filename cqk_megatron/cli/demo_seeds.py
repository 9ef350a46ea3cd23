"""``cqk demo --seeds N``: the demo's largest model, four attention variants, N seeds each,
as one sweep through the local launcher, then a table of validation perplexity with each
seed's difference to standard attention on the same seed.

One seed cannot tell a gap from noise (the demo's report says so); this is the command
that can. The sweep is ``configs/sweeps/demo_seeds.yaml`` with its seeds replaced by
``0 .. N-1``, written to ``OUT/seeds/sweep.yaml``; the runs go to ``OUT/seeds/runs``. Run it
again after Ctrl-C: finished runs are skipped, the others resume.

``--variants`` runs a subset of the variants; config overrides (``attention.X=...``) go into
the sweep's ``common`` settings and its name (``seeds_X_value``), so their runs sit beside
the unchanged ones in ``OUT/seeds/runs``, and the table pairs every row with the standard
runs found there (a study with overrides into the ``--out`` of a plain one).
"""

from __future__ import annotations

import json
import math
import re
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

from cqk_megatron.config.schema import AttentionConfig
from cqk_megatron.run.folder import CONFIG
from cqk_megatron.variants import SCORINGS, VARIANTS

REPO = Path(__file__).resolve().parents[2]
SEEDS_SWEEP = REPO / "configs" / "sweeps" / "demo_seeds.yaml"
BASELINE = "standard"


def write_sweep(
    out: Path,
    seeds: int,
    variants: list[str] | None = None,
    overrides: list[str] | None = None,
) -> Path:
    """``demo_seeds.yaml`` with seeds ``0 .. seeds-1`` (and ``variants``, ``overrides``
    where given), under ``out``; its model files are found under the checkout's
    ``configs/`` (the planner looks there too)."""
    sweep = yaml.safe_load(SEEDS_SWEEP.read_text())
    sweep["seeds"] = list(range(seeds))
    if variants:
        sweep["variants"] = list(variants)
    if overrides:
        settings = dict(parse_override(text) for text in overrides)
        sweep["common"] = {**sweep["common"], **settings}
        sweep["name"] = study_name(sweep["name"], settings)
    path = out / f"{sweep['name']}.yaml" if overrides else out / "sweep.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(sweep, sort_keys=False))
    return path


def parse_override(text: str) -> tuple[str, object]:
    """``section.key=value`` as the sweep's ``common`` holds it (the value read as YAML)."""
    dotted, sep, value = text.partition("=")
    if not sep or "." not in dotted:
        raise ValueError(f"{text!r} is not a config override; write section.key=value")
    return dotted, yaml.safe_load(value)


def study_name(base: str, settings: dict[str, object]) -> str:
    """The sweep's name with each override's key and value, so that its runs are named
    apart from the unchanged ones (``seeds_differential_norm_none``)."""
    parts = [base] + [f"{key.rsplit('.', 1)[-1]}_{value}" for key, value in settings.items()]
    return re.sub(r"[^A-Za-z0-9_]", "_", "_".join(parts))


def step_overrides(steps: int | None) -> list[str]:
    """The demo's ``--steps``: every run that many steps, evaluated and saved each quarter."""
    if steps is None:
        return []
    quarter = max(1, steps // 4)
    return [
        f"train.train_steps={steps}",
        f"train.eval_interval={quarter}",
        f"train.checkpoint.save_interval={quarter}",
        "train.schedule.warmup_steps=1",
    ]


def run_study(
    out: Path,
    seeds: int,
    steps: int | None,
    variants: list[str] | None = None,
    overrides: list[str] | None = None,
) -> int:
    """Corpus, sweep, table; the launcher's exit code if a run failed."""
    data, study = out / "data", out / "seeds"
    python = sys.executable
    corpus = [python, "-m", "data_tools.demo_corpus", "--out", str(data), "--quiet"]
    subprocess.run(corpus, check=True, cwd=REPO)
    sweep = write_sweep(study, seeds, variants, overrides)
    chosen = yaml.safe_load(sweep.read_text())["variants"]
    changed = f", {' '.join(overrides)}" if overrides else ""
    print(
        f"== {seeds} seeds x {len(chosen)} variants of the demo's w128 model "
        f"({SEEDS_SWEEP.name}{changed})"
    )
    submit = [
        python,
        "launch/submit.py",
        "--sweep",
        str(sweep),
        "--cluster",
        "local",
        "--profile",
        "configs/clusters/local.yaml",
        f"log.root={study / 'runs'}",
        f"data.prefixes=[{data / 'demo_text_document'}]",
        f"data.tokenizer={data / 'tokenizer.model'}",
        *step_overrides(steps),
    ]
    code = subprocess.run(submit, cwd=REPO).returncode
    if code != 0:
        return code
    print(format_table(final_perplexities(study / "runs")))
    return 0


def final_perplexities(runs: Path) -> dict[str, dict[int, float]]:
    """``{row: {seed: final validation perplexity}}`` of the finished runs in ``runs``; a
    row is a variant and the settings its study changed (``study_settings``)."""
    table: dict[str, dict[int, float]] = {}
    studies = study_settings(runs.parent)
    for metrics in sorted(runs.glob("*/metrics.jsonl")):
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        finals = [r for r in records if r.get("final")]
        if not finals:
            continue
        config = yaml.safe_load((metrics.parent / CONFIG).read_text())
        settings = studies.get(str(config["name"]).split("-")[0])
        if settings is None:  # a run of no study written here: its scoring's settings say
            settings = scoring_settings(config["attention"])
        row = table.setdefault(variant_of(config["attention"]) + settings, {})
        seed = int(config["seed"])
        if seed in row:
            raise ValueError(
                f"{metrics.parent}: a second run of {variant_of(config['attention'])}{settings}"
                f" with seed {seed} in {runs}; keep one study per setting in an --out folder"
            )
        row[seed] = float(finals[-1]["val_ppl"])
    return table


def study_settings(study: Path) -> dict[str, str]:
    """``{sweep name: " (key=value, ...)"}`` for each study's sweep written in ``study``:
    the settings its ``common`` changes from ``demo_seeds.yaml``'s (empty for the study
    without overrides). Every override names its row, whichever section it sets."""
    base = yaml.safe_load(SEEDS_SWEEP.read_text())["common"]
    labels = {}
    for path in sorted(study.glob("*.yaml")):
        sweep = yaml.safe_load(path.read_text())
        if not isinstance(sweep, dict) or "name" not in sweep:
            continue
        common = sweep.get("common") or {}
        changed = [
            f"{key.rsplit('.', 1)[-1]}={value}"
            for key, value in common.items()
            if key not in base or base[key] != value
        ]
        labels[str(sweep["name"])] = f" ({', '.join(changed)})" if changed else ""
    return labels


def variant_of(attention: dict) -> str:
    """The registry's preset for a run's ``attention`` section (coupling, scoring)."""
    pair = (attention["coupling"], attention["scoring"])
    return next((name for name, preset in VARIANTS.items() if preset == pair), "+".join(pair))


def scoring_settings(attention: dict) -> str:
    """`` (key=value, ...)`` for the scorings' options (the registry's) that a run sets
    away from their defaults; empty where it sets none."""
    defaults = AttentionConfig()
    options = sorted({name for variant in SCORINGS.values() for name in variant.options.values()})
    changed = [
        f"{name}={attention[name]}"
        for name in options
        if name in attention and attention[name] != getattr(defaults, name)
    ]
    return f" ({', '.join(changed)})" if changed else ""


def paired_differences(runs: dict[int, float], baseline: dict[int, float]) -> dict[int, float]:
    """Per seed, ``100 (ppl / baseline ppl - 1)``: the same seed draws the same data order."""
    return {
        seed: 100 * (ppl / baseline[seed] - 1) for seed, ppl in runs.items() if seed in baseline
    }


def spread(values: list[float]) -> str:
    """Mean, sample standard deviation and the standard error of the mean, in percent."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return f"mean {mean:+.1f}%"
    sd = statistics.stdev(values)
    return f"mean {mean:+.1f}%, sd {sd:.1f}, s.e. {sd / math.sqrt(len(values)):.1f}"


def format_table(table: dict[str, dict[int, float]]) -> str:
    """Markdown: per variant the perplexity of each seed, their mean, and the paired
    differences to standard attention with their spread."""
    seeds = sorted({seed for runs in table.values() for seed in runs})
    head = " / ".join(str(s) for s in seeds)
    lines = [
        f"| variant | val. ppl seed {head} | mean | paired vs {BASELINE} (per seed; spread) |",
        "|---|---|---|---|",
    ]
    order = sorted(table, key=lambda v: (v != BASELINE, v))
    for variant in order:
        runs = table[variant]
        ppl = " / ".join(f"{runs[s]:.2f}" if s in runs else "-" for s in seeds)
        mean = statistics.fmean(runs.values())
        paired = "-"
        if variant != BASELINE and BASELINE in table:
            diffs = paired_differences(runs, table[BASELINE])
            if diffs:
                each = " / ".join(f"{diffs[s]:+.1f}%" for s in sorted(diffs))
                paired = f"{each} ({spread(list(diffs.values()))})"
        lines.append(f"| {variant} | {ppl} | {mean:.2f} | {paired} |")
    return "\n".join(lines)

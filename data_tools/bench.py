"""Preprocessing throughput on the demo corpus: MB/s and tokens/s of ``cqk data preprocess`` on
one and on all cores, and, given a Megatron-LM checkout, the ratio against Megatron-LM's
own ``tools/preprocess_data.py`` on the same corpus and tokenizer in the same run (and
whether the two outputs are byte-identical).

    cqk data bench --megatron-lm /path/to/Megatron-LM   # tag core_v0.16.1

Every tool runs as a fresh subprocess, so each figure includes its start-up (Python,
torch and Megatron imports); the processing-phase rates that each tool logs itself
(documents, tokenize and write) are reported beside them.
"""

from __future__ import annotations

import filecmp
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from cqk_megatron.cli.args import new_parser
from data_tools.cli import friendly_errors
from data_tools.demo_corpus import DATASET_NAME, TOKENIZER_NAME, DemoSettings, build_demo
from data_tools.sources import default_workers

# Megatron-LM's megatron.training imports megatron.core's batch-invariant GPU kernels,
# which import triton at import time; preprocess_data.py never calls them. This runner
# (our code, written to a temporary folder) replaces that one module with an import-only
# stand-in and runs the tool unchanged.
_RUNNER = """
import os, runpy, sys, types
import megatron.core.datasets.indexed_dataset  # the installed Megatron-Core
name = "megatron.core.transformer.custom_layers.batch_invariant_kernels"
def _missing(attr):
    if attr.startswith("__"):
        raise AttributeError(attr)
    return lambda *args, **kwargs: None
stand_in = types.ModuleType(name)
stand_in.__getattr__ = _missing
sys.modules[name] = stand_in
tool = sys.argv[1]
sys.argv = [tool, *sys.argv[2:]]
runpy.run_path(tool, run_name="__main__")
"""

_OURS_RATE = re.compile(r"preprocess: .* in ([\d.]+) s \(")
_MLM_RATE = re.compile(r"Processed (\d+) documents \(([\d.]+) docs/s, ([\d.]+) MB/s\)")


@dataclass
class Run:
    name: str
    wall_s: float
    phase_s: float | None  # the tool's own processing time, start-up excluded
    output_prefix: Path


# one tool's run over the corpus: minutes for the whole demo corpus on one core; a tool that
# takes longer is stuck, and the benchmark says so rather than wait on it
RUN_TIMEOUT_S = 3600.0


def _run(command: list[str], cwd: Path | None = None) -> tuple[float, str]:
    start = time.perf_counter()
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, cwd=cwd, env=env, timeout=RUN_TIMEOUT_S
        )
    except subprocess.TimeoutExpired as error:
        raise RuntimeError(f"{command[:4]} did not finish within {RUN_TIMEOUT_S:g} s") from error
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{command[:4]} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return wall, done.stdout + done.stderr


def run_ours(corpus: Path, model: Path, out: Path, workers: int) -> Run:
    prefix = out / f"ours_w{workers}"
    command = [sys.executable, "-m", "data_tools.preprocess", "--input", str(corpus)]
    command += ["--tokenizer", str(model), "--out", str(prefix)]
    command += ["--workers", str(workers), "--force"]
    wall, log = _run(command, cwd=Path(__file__).resolve().parent.parent)
    match = _OURS_RATE.search(log)
    return Run(f"cqk data preprocess, {workers} worker(s)", wall, match and float(match[1]), prefix)


def run_megatron_lm(checkout: Path, corpus: Path, model: Path, out: Path, workers: int) -> Run:
    runner = out / "run_megatron_lm_preprocess.py"
    runner.write_text(_RUNNER)
    prefix = out / "megatron_lm"
    command = [sys.executable, str(runner), str(checkout / "tools" / "preprocess_data.py")]
    command += ["--input", str(corpus), "--json-keys", "text", "--append-eod"]
    command += ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(model)]
    command += ["--workers", str(workers), "--output-prefix", str(prefix), "--log-interval", "1"]
    wall, log = _run(command, cwd=out)
    rates = _MLM_RATE.findall(log)
    phase = int(rates[-1][0]) / float(rates[-1][1]) if rates else None
    name = f"Megatron-LM preprocess_data.py, {workers} worker(s)"
    return Run(name, wall, phase, out / "megatron_lm_text_document")  # the tool's naming


def _median_run(runs: list[Run]) -> Run:
    runs = sorted(runs, key=lambda r: r.wall_s)
    middle = runs[len(runs) // 2]
    phases = [r.phase_s for r in runs if r.phase_s is not None]
    return Run(
        middle.name,
        middle.wall_s,
        statistics.median(phases) if phases else None,
        middle.output_prefix,
    )


def _identical(a: Path, b: Path) -> bool:
    return all(
        filecmp.cmp(f"{a}{suffix}", f"{b}{suffix}", shallow=False) for suffix in (".bin", ".idx")
    )


def _row(run: Run, megabytes: float, tokens: int, baseline: Run | None) -> str:
    ratio = "" if baseline is None else f"{baseline.wall_s / run.wall_s:9.2f}x"
    phase = "" if run.phase_s is None else f"{megabytes / run.phase_s:8.2f} MB/s"
    return (
        f"{run.name:<42} {run.wall_s:7.1f} s {megabytes / run.wall_s:7.2f} MB/s "
        f"{tokens / run.wall_s:11,.0f} tok/s {ratio:>10}   {phase}"
    )


@friendly_errors
def main(argv: list[str] | None = None) -> int:
    parser = new_parser("cqk data bench", __doc__.split("\n\n")[0])
    parser.add_argument("--demo", help="demo corpus folder, built if absent (default data/demo)")
    parser.add_argument("--max-mb", type=float, default=4.0, help="demo corpus size (0: all)")
    parser.add_argument(
        "--megatron-lm",
        default=os.environ.get("MEGATRON_LM"),
        help="Megatron-LM checkout (tag core_v0.16.1) for the baseline (default: $MEGATRON_LM)",
    )
    parser.add_argument(
        "--workers", type=int, default=default_workers(), help="tokenizing processes"
    )
    parser.add_argument("--repeat", type=int, default=1, help="runs per tool (median)")
    args = parser.parse_args(argv)

    settings = DemoSettings(max_bytes=int(args.max_mb * 1e6))
    folder = args.demo or (
        "data/demo"
        if settings.max_bytes == DemoSettings().max_bytes
        else f"data/demo_{args.max_mb:g}mb"
    )
    demo = build_demo(folder, settings, workers=args.workers, progress=False)
    corpus, model = demo.folder / "corpus.jsonl", demo.folder / f"{TOKENIZER_NAME}.model"
    meta = json.loads((demo.folder / f"{DATASET_NAME}.meta.json").read_text())
    megabytes, tokens = meta["bytes"] / 1e6, meta["tokens"]
    print(
        f"demo corpus: {corpus} ({megabytes:.2f} MB, {meta['documents']} documents, "
        f"{tokens:,} tokens, vocab {meta['tokenizer']['vocab_size']})"
    )

    with tempfile.TemporaryDirectory(prefix="cqk-data-bench-") as tmp:
        out = Path(tmp)
        checkout = Path(args.megatron_lm).expanduser() if args.megatron_lm else None
        reason = None
        if checkout is None:
            reason = "no Megatron-LM checkout given (--megatron-lm PATH or MEGATRON_LM)"
        elif not (checkout / "tools" / "preprocess_data.py").is_file():
            reason = f"{checkout} has no tools/preprocess_data.py"
        # the tools take turns within each repeat, so a change in machine load hits all
        runs: dict[str, list[Run]] = {"ours": [], "ours_1": [], "megatron_lm": []}
        for _ in range(args.repeat):
            runs["ours"].append(run_ours(corpus, model, out, args.workers))
            if args.workers > 1:
                runs["ours_1"].append(run_ours(corpus, model, out, 1))
            if reason is None:
                runs["megatron_lm"].append(
                    run_megatron_lm(checkout, corpus, model, out, args.workers)
                )
        ours = _median_run(runs["ours"])
        rows = [ours] + ([_median_run(runs["ours_1"])] if runs["ours_1"] else [])
        baseline = _median_run(runs["megatron_lm"]) if runs["megatron_lm"] else None
        if baseline is not None:
            rows.append(baseline)

        print(
            f"\n{'tool':<42} {'wall':>9} {'end to end':>12} {'':>17} "
            f"{'speed-up':>10}   processing phase"
        )
        for run in rows:
            print(_row(run, megabytes, tokens, baseline))
        if baseline is None:
            print(f"\nMegatron-LM baseline skipped: {reason}")
        else:
            same = _identical(ours.output_prefix, baseline.output_prefix)
            print(f"\noutputs byte-identical to Megatron-LM's (.bin and .idx): {same}")
            if ours.phase_s and baseline.phase_s:
                print(
                    f"processing-phase speed-up over Megatron-LM: "
                    f"{baseline.phase_s / ours.phase_s:.2f}x"
                )
        if args.workers > 1 and rows[1].phase_s and ours.phase_s:
            print(
                f"{args.workers} workers vs 1 (processing phase): "
                f"{rows[1].phase_s / ours.phase_s:.2f}x"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

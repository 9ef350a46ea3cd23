"""``python -m cqk_megatron.repro``: the cpu-tiny preset end to end on a small embedded
corpus (two variants, four steps each, real training processes), the comparison table
and plot, identical data across variants, a re-run that skips finished runs, a re-run
with another budget that is refused, and every kind of bad argument."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import json
import math
from pathlib import Path

import pytest

from cqk_megatron.cli.repro import main
from cqk_megatron.repro.presets import PRESETS, ReproError, canonical_variant, parse_tokens
from data_tools.demo_corpus import DemoSettings, build_demo

STEPS = 4
TOKENS = STEPS * 16 * 128  # cpu-tiny: 16 sequences of 128 tokens a step
# keep the test fast: one validation batch, an evaluation every other step
FAST = ["train.eval_iters=1", "train.eval_interval=2"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("repro") / "data"
    return build_demo(
        folder, DemoSettings(max_bytes=150_000, vocab_size=700), progress=False
    ).prefix


def repro(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def finished(corpus, tmp_path_factory):
    """The comparison run once; (out folder, stdout) shared by the end-to-end checks."""
    out = tmp_path_factory.mktemp("repro") / "out"
    argv = [
        "--preset",
        "cpu-tiny",
        "--data",
        str(corpus),
        "--tokens",
        str(TOKENS),
        "--variants",
        "standard,hamiltonian",
        "--out",
        str(out),
        "--quiet",
        *FAST,
    ]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(argv)
    assert code == 0, stdout.getvalue()
    return out, argv, stdout.getvalue()


def test_comparison_table_plot_and_same_data(finished):
    out, _, stdout = finished
    rows = list(csv.DictReader((out / "comparison.csv").open()))
    assert [r["variant"] for r in rows] == ["standard", "coupled"]
    standard, coupled = rows
    for row in rows:
        assert row["seeds"] == "0"
        assert 1.0 < float(row["val_ppl"]) < 700  # below uniform over the 700-token vocabulary
        assert float(row["tokens_per_s"]) > 0
        assert int(row["tokens"]) == TOKENS
    assert float(standard["change_vs_standard_pct"]) == 0.0
    assert float(standard["step_time_vs_standard"]) == 1.0
    expected = 100 * (float(coupled["val_ppl"]) / float(standard["val_ppl"]) - 1)
    assert math.isclose(float(coupled["change_vs_standard_pct"]), expected, rel_tol=1e-9)
    assert int(coupled["params_total"]) > int(standard["params_total"])  # the coupling MLPs

    markdown = (out / "comparison.md").read_text()
    assert "| standard | 0 |" in markdown and "| coupled | 0 |" in markdown
    assert "every variant saw the same first batch" in markdown
    png = (out / "loss_vs_tokens.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000

    record = json.loads((out / "comparison.json").read_text())
    assert record["same_first_batch_by_seed"] == {"0": True}
    hashes = []
    for variant in ("standard", "coupled"):
        lines = (out / "runs" / f"cpu-tiny-{variant}-s0" / "metrics.jsonl").read_text()
        summary = [json.loads(x) for x in lines.splitlines() if '"summary"' in x][-1]
        assert summary["steps"] == STEPS
        hashes.append(summary["first_batch_sha256"])
    assert hashes[0] is not None and len(hashes[0]) == 64 and hashes[0] == hashes[1]
    assert "Where everything is" in stdout and str(out / "comparison.md") in stdout


def test_rerun_skips_finished_runs(finished, capsys):
    out, argv, _ = finished
    metrics = {
        v: (out / "runs" / f"cpu-tiny-{v}-s0" / "metrics.jsonl").read_bytes()
        for v in ("standard", "coupled")
    }
    code, stdout, stderr = repro(capsys, *argv)
    assert code == 0, stderr
    assert "cpu-tiny-standard-s0: done, skipped" in stdout
    assert "cpu-tiny-coupled-s0: done, skipped" in stdout
    for variant, before in metrics.items():  # nothing trained again
        assert (out / "runs" / f"cpu-tiny-{variant}-s0" / "metrics.jsonl").read_bytes() == before


def test_rerun_with_another_budget_is_refused(finished, capsys):
    out, argv, _ = finished
    changed = [a if a != str(TOKENS) else str(2 * TOKENS) for a in argv]
    code, _, stderr = repro(capsys, *changed)
    assert code == 2
    assert "made with other settings" in stderr and "train.train_steps: 4 -> 8" in stderr


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--preset", "paper-7b"], ["--preset 'paper-7b' is unknown", "cpu-tiny"]),
        (["--preset", "cpu-tiny", "--variants", "standard,lepfrog"], ["--variants", "'lepfrog'"]),
        (["--preset", "cpu-tiny", "--variants", ","], ["--variants is empty"]),
        (["--preset", "cpu-tiny", "--seeds", "0,x"], ["--seeds", "'x' is not an integer"]),
        (["--preset", "cpu-tiny", "--tokens", "lots"], ["--tokens 'lots'", "80M"]),
        (["--preset", "cpu-tiny", "--tokens", "-5"], ["must be positive"]),
        (["--variants", "standard"], ["--preset"]),
        (["--preset", "cpu-tiny", "seed=3"], ["seed is set by the command", "--seeds"]),
        (["--preset", "cpu-tiny", "attention.coupling=euler"], ["use --variants"]),
        (["--preset", "cpu-tiny", "oops"], ["'oops' is neither an option nor an override"]),
    ],
)
def test_bad_arguments_name_the_argument_and_the_fix(capsys, tmp_path, argv, expected):
    code, _, stderr = repro(capsys, *argv, "--out", str(tmp_path / "out"))
    assert code == 2
    for text in expected:
        assert text in stderr
    assert not (tmp_path / "out").exists()  # refused before building data or training


def test_missing_data_and_tokenizer(capsys, tmp_path, corpus):
    missing = tmp_path / "nowhere" / "corpus_text_document"
    code, _, stderr = repro(
        capsys, "--preset", "cpu-tiny", "--data", str(missing), "--out", str(tmp_path)
    )
    assert code == 2 and f"--data {missing}: no such file" in stderr
    assert "leave --data out" in stderr
    code, _, stderr = repro(
        capsys, "--preset", "cpu-tiny", "--data", str(corpus), "--tokenizer",
        str(tmp_path / "no.model"), "--out", str(tmp_path),
    )  # fmt: skip
    assert code == 2 and "--tokenizer" in stderr and "no such file" in stderr
    code, _, stderr = repro(
        capsys, "--preset", "cpu-tiny", "--nproc", "3", "--data", str(corpus), "--out",
        str(tmp_path),
    )  # fmt: skip
    assert code == 2 and "--nproc 3" in stderr and "global_batch_size=16" in stderr


def test_a_variant_registered_with_aliases_is_a_repro_variant_by_each_name(monkeypatch):
    from cqk_megatron.variants import register_variant, registry

    monkeypatch.setattr(registry, "_VARIANTS", dict(registry._VARIANTS))
    monkeypatch.setattr(registry, "_ALIASES", dict(registry._ALIASES))
    register_variant("euler_differential", "euler", "differential", aliases=("ediff",))
    assert canonical_variant("EDiff") == canonical_variant("euler_differential")
    assert canonical_variant("ediff") == "euler_differential"
    with pytest.raises(ValueError, match="names another variant"):
        register_variant("coupled_euler2", "euler", "standard", aliases=("euler",))


def test_variant_aliases_and_token_suffixes():
    assert canonical_variant("hamiltonian") == "coupled"
    assert canonical_variant("Euler") == "coupled_euler"
    assert canonical_variant("mlp-only") == "mlp_only"
    with pytest.raises(ReproError, match="not a variant"):
        canonical_variant("quantum")
    preset = PRESETS["paper-60m"]
    assert parse_tokens("80M", preset) == 80_000_000
    assert parse_tokens("1.2B", preset) == 1_200_000_000
    assert parse_tokens(None, preset) == preset.tokens
    for preset in PRESETS.values():
        assert preset.config.is_file()


def test_raw_corpus_is_tokenized_once(tmp_path):
    """``--data`` a text file: a tokenizer is trained and the text tokenized into OUT/data,
    then reused while the file is unchanged, redone when it changes."""
    from cqk_megatron.data.metadata import read_meta
    from cqk_megatron.repro.data import resolve_data

    text = tmp_path / "corpus.txt"
    paragraphs = [
        f"Paragraph {i}: the query and the key evolve together for {i % 7 + 1} steps, "
        f"then attention scores them; standard attention keeps them fixed ({i * 37 % 101})."
        for i in range(400)
    ]
    text.write_text("\n\n".join(paragraphs) + "\n")
    preset = dataclasses.replace(PRESETS["cpu-tiny"], tokenizer_vocab=300)
    first = resolve_data(str(text), None, preset, tmp_path / "out")
    assert first.prefix == tmp_path / "out" / "data" / "corpus_text_document"
    assert first.vocab_size == 300 and first.tokenizer.is_file()
    assert "tokenized now" in first.description
    assert read_meta(first.prefix)["documents"] == 400
    again = resolve_data(str(text), None, preset, tmp_path / "out")
    assert "tokenized before" in again.description and again.prefix == first.prefix
    text.write_text("\n\n".join(paragraphs[:200]) + "\n")
    changed = resolve_data(str(text), None, preset, tmp_path / "out")
    assert "tokenized now" in changed.description
    assert read_meta(changed.prefix)["documents"] == 200


def test_a_mostly_invalid_text_is_refused_unless_max_invalid_utf8_allows_it(tmp_path):
    """The data tools' refusal names ``--max-invalid-utf8``; cqk-repro takes it too."""
    import random

    from cqk_megatron.cli.repro import build_parser
    from cqk_megatron.repro.data import CorpusOptions, resolve_data
    from data_tools.sources import MAX_INVALID_UTF8

    generator = random.Random(0)
    text = tmp_path / "noise.txt"
    words = [
        f"Paragraph {i}: the query and the key evolve together for {i % 7 + 1} steps, "
        f"then attention scores them; standard attention keeps them fixed ({i * 37 % 101})."
        for i in range(400)
    ]
    noise = bytes(generator.randrange(0x80, 0xC0) for _ in range(20000))  # lone continuations
    text.write_bytes("\n\n".join(words).encode() + b"\n\n" + noise + b"\n")
    preset = dataclasses.replace(PRESETS["cpu-tiny"], tokenizer_vocab=400)
    with pytest.raises(Exception, match="--max-invalid-utf8"):
        resolve_data(str(text), None, preset, tmp_path / "refused")
    argv = ["--preset", "cpu-tiny", "--data", str(text), "--max-invalid-utf8", "1"]
    args = build_parser().parse_args(argv)
    reading = CorpusOptions(args.text_unit, args.text_field, args.input_format, 1.0)
    assert args.max_invalid_utf8 == 1.0
    assert CorpusOptions().as_kwargs().get("max_invalid_utf8") is None  # same fingerprints
    assert CorpusOptions().max_invalid_utf8 == MAX_INVALID_UTF8
    allowed = resolve_data(str(text), None, preset, tmp_path / "allowed", reading)
    assert allowed.prefix.with_suffix(".bin").is_file()

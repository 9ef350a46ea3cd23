"""Data tools end to end on tiny corpora made here: SentencePiece training, preprocessing
into Megatron's indexed format (read back through Megatron's own ``IndexedDataset``),
statistics, the embedded demo corpus, and every kind of bad input."""

from __future__ import annotations

import hashlib
import io
import json
import random
from pathlib import Path

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from cqk_megatron.config import ConfigError, load_config
from cqk_megatron.data import DataError, check_vocab_fits, load_tokenizer
from data_tools import demo_corpus, preprocess, stats
from data_tools import tokenizer as tokenizer_tool
from data_tools.progress import Progress

WORDS = {
    "en": "the model reads tokens and writes text over many quiet days".split(),
    "fr": "café naïve été déjà façon œuvre garçon élève".split(),
    "de": "Grüße Straße Mädchen Übung schön fünf".split(),
    "el": "Ελληνικά κείμενα λόγος γλώσσα".split(),
    "ru": "привет мир данные модель".split(),
    "ja": "日本語 テキスト 東京 データ".split(),
    "zh": "中文 模型 数据 训练".split(),
}


def make_documents(count: int, seed: int = 0) -> list[str]:
    """Mixed-script prose, multi-paragraph documents and indented code."""
    rng = random.Random(seed)
    docs = []
    for i in range(count):
        kind = i % 4
        if kind == 3:
            body = f"def f{i}(x):\n    if x > {i}:\n\treturn x * 2\n    return None"
        else:
            lang = rng.choice(sorted(WORDS))
            sentences = [
                " ".join(rng.choice(WORDS[lang]) for _ in range(rng.randint(3, 12)))
                for _ in range(rng.randint(1, 3))
            ]
            body = (".\n\n" if kind == 1 else ". ").join(sentences) + f" #{i}"
        docs.append(body)
    return docs


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    with open(path, "w", encoding="utf-8") as out:
        for i, doc in enumerate(docs):
            out.write(json.dumps({field: doc, "id": i}, ensure_ascii=False) + "\n")
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    docs = make_documents(300)
    return docs, write_jsonl(folder / "docs.jsonl", docs)


@pytest.fixture(scope="module")
def spm_model(corpus, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    recipe = tokenizer_tool.TokenizerRecipe(
        vocab_size=600, sample_documents=250, character_coverage=1.0, threads=2
    )
    trained = tokenizer_tool.train_tokenizer([str(corpus[1])], folder / "spm", recipe)
    return trained


@pytest.fixture(scope="module")
def dataset(corpus, spm_model, tmp_path_factory):
    prefix = tmp_path_factory.mktemp("out") / "docs_text_document"
    result = preprocess.preprocess(
        [str(corpus[1])], prefix, spm_model.model, workers=2, progress=False
    )
    return prefix, result


# --------------------------------------------------------------------------------------
# tokenizer training
# --------------------------------------------------------------------------------------


def test_tokenizer_model_and_recipe(spm_model):
    tok = load_tokenizer(spm_model.model)
    assert tok.vocab_size == 600
    assert (tok.bos, tok.eod, tok.pad) == (1, 2, 3)
    recipe = json.loads(spm_model.recipe_file.read_text())
    assert recipe["recipe"]["model_type"] == "bpe"
    assert recipe["recipe"]["vocab_size"] == 600
    assert recipe["recipe"]["byte_fallback"] is True
    assert recipe["documents_total"] == 300
    assert recipe["documents_sampled"] == 250 == spm_model.documents_sampled
    assert recipe["inputs"][0]["documents"] == 300
    assert Path(f"{spm_model.model.with_suffix('')}.vocab").read_text().count("\n") == 600
    # byte fallback: characters never seen in training survive, with no <unk>
    unseen = "emoji 😀 and Hangul 한국어"
    ids = tok.tokenize(unseen)
    assert 0 not in ids
    assert tok.detokenize(ids) == tok.normalize(unseen)


def test_unigram_tokenizer_from_text_file(tmp_path, corpus):
    text_file = tmp_path / "corpus.txt"
    text_file.write_text("\n\n".join(corpus[0][:120]), encoding="utf-8")
    recipe = tokenizer_tool.TokenizerRecipe(
        model_type="unigram", vocab_size=400, character_coverage=0.9995, pad_id=-1, threads=2
    )
    trained = tokenizer_tool.train_tokenizer([str(text_file)], tmp_path / "uni", recipe)
    tok = load_tokenizer(trained.model)
    assert tok.vocab_size == 400 and tok.pad == -1
    assert tok.kind == "sentencepiece"
    record = json.loads(trained.recipe_file.read_text())
    assert record["recipe"]["model_type"] == "unigram"
    for doc in corpus[0][:50]:
        assert tok.detokenize(tok.tokenize(doc)) == tok.normalize(doc)


def test_tokenizer_refuses_to_overwrite_and_bad_vocab(tmp_path, spm_model, corpus):
    prefix = spm_model.model.with_suffix("")
    with pytest.raises(DataError, match="--force"):
        tokenizer_tool.train_tokenizer([str(corpus[1])], prefix)
    with pytest.raises(DataError, match="--vocab-size 100 leaves no room"):
        tokenizer_tool.train_tokenizer(
            [str(corpus[1])], tmp_path / "tiny", tokenizer_tool.TokenizerRecipe(vocab_size=100)
        )
    with pytest.raises(DataError, match="--vocab-size 50000 does not fit"):
        tokenizer_tool.train_tokenizer(
            [str(corpus[1])],
            tmp_path / "huge",
            tokenizer_tool.TokenizerRecipe(model_type="unigram", vocab_size=50000),
        )
    assert not list(tmp_path.glob("huge*")) and not list(tmp_path.glob(".huge*"))


# --------------------------------------------------------------------------------------
# preprocessing
# --------------------------------------------------------------------------------------


def test_round_trip_through_megatron_indexed_dataset(corpus, spm_model, dataset):
    docs = corpus[0]
    prefix, result = dataset
    tok = load_tokenizer(spm_model.model)
    index = IndexedDataset(str(prefix))
    assert len(index) == len(docs) == result.documents
    non_ascii = 0
    for i, doc in enumerate(docs):
        ids = index[i]
        assert ids[-1] == tok.eod and tok.eod not in ids[:-1]
        assert tok.detokenize(ids[:-1]) == tok.normalize(doc)
        non_ascii += not doc.isascii()
    assert non_ascii > 100  # the check covered plenty of non-ASCII text


def test_idx_token_counts_equal_sum_over_documents(corpus, spm_model, dataset):
    prefix, result = dataset
    tok = load_tokenizer(spm_model.model)
    expected = [len(tok.tokenize(doc)) + 1 for doc in corpus[0]]  # + EOD
    index = IndexedDataset(str(prefix))
    assert index.sequence_lengths.tolist() == expected
    assert int(index.sequence_lengths.sum()) == sum(expected) == result.tokens
    assert index.document_indices.tolist() == list(range(len(expected) + 1))
    meta = json.loads(Path(f"{prefix}.meta.json").read_text())
    assert meta["tokens"] == sum(expected) and meta["documents"] == len(expected)
    assert meta["tokenizer"]["vocab_size"] == 600 and meta["tokenizer"]["eod"] == tok.eod
    assert meta["dtype"] == "uint16"
    assert Path(f"{prefix}.bin").stat().st_size == 2 * sum(expected)


def test_parquet_saved_dataset_and_text_units(tmp_path, corpus, spm_model):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = corpus[0][:40]
    pq.write_table(pa.table({"body": docs}), tmp_path / "docs.parquet")
    datasets.Dataset.from_dict({"content": docs}).save_to_disk(str(tmp_path / "saved"))
    jsonl = write_jsonl(tmp_path / "docs.jsonl", docs)
    out = tmp_path / "out"
    runs = {
        "jsonl": ([str(jsonl)], "text"),
        "parquet": ([str(tmp_path / "docs.parquet")], "body"),
        "saved": ([str(tmp_path / "saved")], "content"),
    }
    tokens = {}
    for name, (inputs, field) in runs.items():
        preprocess.preprocess(
            inputs, out / name, spm_model.model, text_field=field, workers=1, progress=False
        )
        index = IndexedDataset(str(out / name))
        tokens[name] = [index[i].tolist() for i in range(len(index))]
    assert tokens["jsonl"] == tokens["parquet"] == tokens["saved"]
    assert len(tokens["jsonl"]) == 40

    text = tmp_path / "plain.txt"
    text.write_text("one line\nsecond line\n\nnew paragraph\n", encoding="utf-8")
    expected = {"line": 3, "paragraph": 2, "file": 1}  # blank lines are not documents
    for unit, count in expected.items():
        result = preprocess.preprocess(
            [str(text)],
            out / f"plain_{unit}",
            spm_model.model,
            text_unit=unit,
            workers=1,
            progress=False,
        )
        assert result.documents == count, unit


def test_hugging_face_tokenizer_folder(tmp_path, corpus):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(corpus[0], trainer)
    folder = tmp_path / "hf"
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>").save_pretrained(folder)

    tok = load_tokenizer(folder)
    assert tok.kind == "huggingface" and tok.eod == bpe.token_to_id("<|endoftext|>")
    docs = corpus[0][:60]
    prefix = tmp_path / "hf_text_document"
    preprocess.preprocess(
        [str(write_jsonl(tmp_path / "d.jsonl", docs))], prefix, folder, workers=2, progress=False
    )
    index = IndexedDataset(str(prefix))
    for i, doc in enumerate(docs):
        assert index[i][-1] == tok.eod
        assert tok.detokenize(index[i][:-1]) == doc  # byte-level BPE: exact


def test_progress_plain_lines_when_not_a_terminal():
    stream = io.StringIO()
    bar = Progress(10, "preprocess", stream=stream, interval_s=0.0)
    bar.update(4, 4_000_000, 1000)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("preprocess: 4/10 documents (40%)")
    assert "docs/s" in lines[0] and "MB/s" in lines[0] and "tokens/s" in lines[0]
    assert "4.00 MB" in lines[-1]


# --------------------------------------------------------------------------------------
# statistics
# --------------------------------------------------------------------------------------


def test_stats(dataset, spm_model, capsys):
    prefix, result = dataset
    found = stats.dataset_stats(str(prefix), top_k=5, tokenizer=load_tokenizer(spm_model.model))
    assert (found.documents, found.tokens) == (result.documents, result.tokens)
    assert found.eod_id == 2 and found.eod_count == result.documents
    assert found.mean_length == pytest.approx(result.tokens / result.documents)
    counts = [t.count for t in found.top]
    assert len(counts) == 5 and counts == sorted(counts, reverse=True)
    data = np.fromfile(f"{prefix}.bin", dtype=np.uint16)
    assert counts[0] == np.bincount(data).max()
    assert stats.main([str(prefix), "--top-k", "3"]) == 0
    out = capsys.readouterr().out
    assert f"documents       {result.documents:,}" in out and "top 3 tokens" in out


# --------------------------------------------------------------------------------------
# the demo corpus
# --------------------------------------------------------------------------------------


def test_demo_corpus_builds_then_skips_then_repairs(tmp_path):
    settings = demo_corpus.DemoSettings(max_bytes=150_000, vocab_size=700)
    folder = tmp_path / "demo"
    first = demo_corpus.build_demo(folder, settings, workers=2, progress=False)
    assert not first.skipped and first.documents > 5
    assert 100_000 < first.corpus_bytes <= 150_000
    kinds = {json.loads(line)["kind"] for line in open(folder / "corpus.jsonl")}
    assert kinds == {"docs", "source"}
    index = IndexedDataset(str(first.prefix))
    assert len(index) == first.documents and int(index.sequence_lengths.sum()) == first.tokens
    assert load_tokenizer(folder).vocab_size == 700  # the folder works as data.tokenizer
    # the JSON records carry times; the data itself must be the same on every build
    data_files = [p for p in demo_corpus.output_files(folder) if p.suffix != ".json"]
    hashes = {p.name: sha256(p) for p in data_files}

    again = demo_corpus.build_demo(folder, settings, workers=2, progress=False)
    assert again.skipped and again.tokens == first.tokens

    Path(f"{first.prefix}.bin").write_bytes(b"half")  # a damaged output is redone
    repaired = demo_corpus.build_demo(folder, settings, workers=2, progress=False)
    assert not repaired.skipped
    assert {p.name: sha256(p) for p in data_files} == hashes

    different = demo_corpus.DemoSettings(max_bytes=100_000, vocab_size=700)
    assert demo_corpus.is_complete(folder, different) is None
    (folder / "manifest.json").unlink()  # no record of what was built: not complete
    assert demo_corpus.is_complete(folder, settings) is None


def test_an_interrupted_demo_corpus_is_rebuilt_by_the_same_command(tmp_path, monkeypatch):
    """Interrupted after its corpus, the demo leaves a manifest of its own that lists no
    file: not complete, and its files still known as the demo's, so the same command
    rebuilds them (a folder of files without that manifest it refuses: test_fuzz.py)."""
    settings = demo_corpus.DemoSettings(max_bytes=60_000, vocab_size=500)
    folder = tmp_path / "demo"

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(demo_corpus, "train_tokenizer", interrupt)
        with pytest.raises(KeyboardInterrupt):
            demo_corpus.build_demo(folder, settings, workers=1, progress=False)
    assert (folder / "corpus.jsonl").is_file()
    assert demo_corpus.is_complete(folder, settings) is None
    rebuilt = demo_corpus.build_demo(folder, settings, workers=1, progress=False)
    assert not rebuilt.skipped and demo_corpus.is_complete(folder, settings) is not None


# --------------------------------------------------------------------------------------
# bad input: each gets a clear error naming the file and the fix
# --------------------------------------------------------------------------------------


def test_empty_files(tmp_path, spm_model):
    for name, content in [("empty.txt", b""), ("blank.jsonl", b"  \n\n "), ("e.parquet", b"")]:
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(DataError, match=rf"'{path}' is empty.*remove it from the inputs"):
            preprocess.preprocess([str(path)], tmp_path / "out", spm_model.model, progress=False)
    rows = tmp_path / "empty_rows.jsonl"
    rows.write_text('{"text": ""}\n{"text": "  "}\n')
    with pytest.raises(DataError, match=rf"'{rows}': every 'text' value is empty"):
        preprocess.preprocess([str(rows)], tmp_path / "out", spm_model.model, progress=False)
    assert not list(tmp_path.glob("out*")) and not list(tmp_path.glob(".out*"))


def test_missing_text_field(tmp_path, spm_model):
    path = write_jsonl(tmp_path / "records.jsonl", ["some text"], field="body")
    with pytest.raises(DataError) as error:
        preprocess.preprocess([str(path)], tmp_path / "out", spm_model.model, progress=False)
    message = str(error.value)
    assert str(path) in message and "no field 'text'" in message
    assert "body" in message and "--text-field" in message
    # among several inputs, the one without the field is named
    good = write_jsonl(tmp_path / "good.jsonl", ["fine text"])
    with pytest.raises(DataError, match=rf"input '{path}' has no field 'text'"):
        preprocess.preprocess(
            [str(good), str(path)], tmp_path / "out", spm_model.model, progress=False
        )
    numbers = tmp_path / "numbers.jsonl"
    numbers.write_text('{"text": 1}\n{"text": 2}\n')
    with pytest.raises(DataError, match=rf"'{numbers}': field 'text' is not text \(line 1's"):
        preprocess.preprocess([str(numbers)], tmp_path / "out", spm_model.model, progress=False)


def test_malformed_json_names_the_file(tmp_path, spm_model):
    good = write_jsonl(tmp_path / "good.jsonl", ["fine text"])
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "a"}\nnot json\n')
    match = rf"cannot read '{broken}' as json: line 2 is not valid JSON.*one JSON object"
    with pytest.raises(DataError, match=match):
        preprocess.preprocess(
            [str(good), str(broken)], tmp_path / "out", spm_model.model, progress=False
        )


def test_non_utf8_bytes_are_replaced_counted_and_reported(tmp_path, spm_model, capsys):
    path = tmp_path / "latin1.txt"
    path.write_bytes(b"good line\n" + b"caf\xe9 cr\xe8me \xff\n" + "ok é\n".encode())
    result = preprocess.preprocess(
        [str(path)],
        tmp_path / "out",
        spm_model.model,
        text_unit="line",
        workers=1,
        progress=False,
    )
    err = capsys.readouterr().err
    assert f"'{path}' is not valid UTF-8: replaced 3 bad byte sequence(s)" in err
    assert "first at byte 13" in err
    assert result.inputs[0].replaced_bytes == 3
    meta = json.loads(Path(f"{tmp_path / 'out'}.meta.json").read_text())
    assert meta["replaced_invalid_utf8"] == 3
    tok = load_tokenizer(spm_model.model)
    index = IndexedDataset(str(tmp_path / "out"))
    assert tok.detokenize(index[1][:-1]) == "caf\ufffd cr\ufffdme \ufffd"
    assert tok.detokenize(index[2][:-1]) == "ok é"  # valid text around it is untouched


def test_unknown_file_type(tmp_path, spm_model, capsys):
    path = tmp_path / "table.csv"
    path.write_text("text\nhello\n")
    with pytest.raises(DataError) as error:
        preprocess.preprocess([str(path)], tmp_path / "out", spm_model.model, progress=False)
    message = str(error.value)
    assert str(path) in message and "unknown file type .csv" in message
    assert "--input-format" in message
    # the command line turns it into one line and exit status 2
    args = ["--input", str(path), "--tokenizer", str(spm_model.model)]
    assert preprocess.main([*args, "--output-prefix", str(tmp_path / "o")]) == 2
    assert "error: input" in capsys.readouterr().err
    # forcing the format reads it as text
    result = preprocess.preprocess(
        [str(path)],
        tmp_path / "out",
        spm_model.model,
        input_format="text",
        text_unit="line",
        workers=1,
        progress=False,
    )
    assert result.documents == 2


def test_tokenizer_vocab_larger_than_model(spm_model, tmp_path, capsys, corpus):
    tok = load_tokenizer(spm_model.model)
    small = load_config(None, ["model.vocab_size=512"])
    with pytest.raises(ConfigError) as error:
        check_vocab_fits(tok, small)
    message = str(error.value)
    assert str(spm_model.model) in message and "600 tokens" in message
    assert "model.vocab_size=512" in message and "set model.vocab_size=600" in message
    check_vocab_fits(tok, load_config(None, ["model.vocab_size=600"]))  # fits exactly
    config = tmp_path / "small.yaml"
    config.write_text("model:\n  vocab_size: 512\n")
    argv = [
        "--input",
        str(corpus[1]),
        "--tokenizer",
        str(spm_model.model),
        "--config",
        str(config),
        "--output-prefix",
        str(tmp_path / "never"),
    ]
    assert preprocess.main(argv) == 2
    assert "set model.vocab_size=600" in capsys.readouterr().err
    assert not list(tmp_path.glob("*never*"))


def test_bad_tokenizer_paths(tmp_path):
    with pytest.raises(DataError, match="does not exist; train one with cqk data tokenizer"):
        load_tokenizer(tmp_path / "missing.model")
    junk = tmp_path / "junk.model"
    junk.write_text("not a model")
    with pytest.raises(DataError, match=rf"'{junk}' is not a SentencePiece model"):
        load_tokenizer(junk)
    with pytest.raises(DataError, match="holds neither tokenizer.json"):
        load_tokenizer(tmp_path)


def test_existing_output_is_refused_and_kept(dataset, corpus, spm_model):
    prefix, _ = dataset
    files = [Path(f"{prefix}{s}") for s in (".bin", ".idx", ".meta.json")]
    before = {p: (sha256(p), p.stat().st_mtime_ns) for p in files}
    with pytest.raises(DataError) as error:
        preprocess.preprocess([str(corpus[1])], prefix, spm_model.model, progress=False)
    assert f"'{prefix}' already holds a dataset" in str(error.value)
    assert "--force" in str(error.value)
    assert {p: (sha256(p), p.stat().st_mtime_ns) for p in files} == before


def test_interrupted_overwrite_keeps_the_old_dataset(tmp_path, corpus, spm_model, monkeypatch):
    prefix = tmp_path / "kept"
    preprocess.preprocess([str(corpus[1])], prefix, spm_model.model, workers=1, progress=False)
    files = [Path(f"{prefix}{s}") for s in (".bin", ".idx", ".meta.json")]
    before = {p: sha256(p) for p in files}

    calls = {"n": 0}
    real = preprocess.encode_batch

    def dies_midway(texts, tokenizer=None):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt  # as if the user pressed Ctrl-C mid-run
        return real(texts, tokenizer)

    monkeypatch.setattr(preprocess, "encode_batch", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        preprocess.preprocess(
            [str(corpus[1])],
            prefix,
            spm_model.model,
            workers=1,
            docs_per_task=16,
            overwrite=True,
            progress=False,
        )
    assert calls["n"] == 2
    assert {p: sha256(p) for p in files} == before  # the old dataset is untouched
    assert not list(tmp_path.glob(".kept*"))  # and no temporary leftovers
    with pytest.raises(KeyboardInterrupt):  # a fresh prefix: nothing usable-looking is left
        calls["n"] = 0
        preprocess.preprocess(
            [str(corpus[1])],
            tmp_path / "fresh",
            spm_model.model,
            workers=1,
            docs_per_task=16,
            progress=False,
        )
    assert list(tmp_path.iterdir()) == [p for p in tmp_path.iterdir() if p.name.startswith("kept")]


def test_the_preprocessing_benchmark_bounds_each_tool_it_runs(monkeypatch):
    """cqk data bench waits on a tool at most RUN_TIMEOUT_S, then says which one hung."""
    import sys

    from data_tools import bench

    monkeypatch.setattr(bench, "RUN_TIMEOUT_S", 0.5)
    with pytest.raises(RuntimeError, match=r"did not finish within 0.5 s"):
        bench._run([sys.executable, "-c", "import time; time.sleep(30)"])

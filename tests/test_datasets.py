"""Training-side datasets: ``build_datasets`` over indexed data made here, through
Megatron's ``BlendedMegatronDatasetBuilder`` / ``GPTDataset`` / ``BlendedDataset``, in a
plain process and in the single-process group, plus every config and data error."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cqk_megatron.config import ConfigError, load_config
from cqk_megatron.data import DataError, build_datasets, load_tokenizer
from cqk_megatron.data.builder import blend_counts, resolve_tokenizer
from cqk_megatron.data.tokenizer import IdsOnlyTokenizer
from cqk_megatron.parallel.process_groups import init_single_process
from data_tools.preprocess import preprocess
from data_tools.tokenizer import TokenizerRecipe, train_tokenizer

SEQ = 16
REPO = Path(__file__).resolve().parent.parent


def _write(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Two datasets with disjoint alphabets (letters a-k / digits), one tokenizer."""
    root = tmp_path_factory.mktemp("datasets")
    rng = random.Random(0)
    letters = [
        " ".join(
            "".join(rng.choice("abcdefghijk") for _ in range(rng.randint(2, 5))) for _ in range(12)
        )
        for _ in range(200)
    ]
    digits = [" ".join(str(rng.randint(0, 99999)) for _ in range(8)) for _ in range(200)]
    letters_file, digits_file = _write(root / "a.jsonl", letters), _write(root / "b.jsonl", digits)
    tok = train_tokenizer(
        [str(letters_file), str(digits_file)],
        root / "spm",
        TokenizerRecipe(vocab_size=320, character_coverage=1.0, threads=2),
    ).model
    for name, source in (("letters", letters_file), ("digits", digits_file)):
        preprocess([str(source)], root / name, tok, workers=1, progress=False)
    return root, tok


def config_for(root: Path, *overrides: str):
    return load_config(
        None,
        [
            f"model.seq_length={SEQ}",
            "model.vocab_size=320",
            f"data.cache_dir={root / 'cache'}",
            *overrides,
        ],
    )


def source_of(sample: dict, tokenizer) -> str:
    """'letters' or 'digits', from the pieces of a sample (EOD and bare spaces are shared)."""
    pieces = tokenizer.pieces(sample["tokens"].tolist() + sample["labels"][-1:].tolist())
    has_letter = any(any(c in "abcdefghijk" for c in p) for p in pieces if p != "</s>")
    has_digit = any(any(c.isdigit() for c in p) for p in pieces)
    assert has_letter != has_digit, pieces
    return "letters" if has_letter else "digits"


def _blend(root: Path, samples: int = 2000, *overrides: str):
    config = config_for(
        root,
        f"data.prefixes=[{root / 'letters'}, {root / 'digits'}]",
        "data.weights=[0.7, 0.3]",
        "data.split=100,0,0",
        *overrides,
    )
    return build_datasets(config, samples, 0, 0)


def test_blend_draws_samples_in_the_weighted_ratio(data):
    root, tok = data
    train, valid, test = _blend(root)
    assert type(train).__name__ == "BlendedDataset" and valid is None and test is None
    assert len(train) == 2000
    tokenizer = load_tokenizer(tok)
    drawn = [source_of(train[i], tokenizer) for i in range(len(train))]
    share = drawn.count("letters") / len(drawn)
    assert abs(share - 0.7) <= 0.02, share
    counts = blend_counts(train)  # Megatron's own bookkeeping agrees with the content
    assert counts.tolist() == [drawn.count("letters"), drawn.count("digits")]


def test_blend_without_weights_is_proportional_to_size_and_full_length(data):
    root, tok = data
    letters, digits = root / "letters", root / "digits"
    config = config_for(root, f"data.prefixes=[{letters}, {digits}]", "data.split=100,0,0")
    train, _, _ = build_datasets(config, 3000, 0, 0)  # several epochs of the data
    assert len(train) >= 3000  # Megatron rounds each share up
    tokens = [int(np.fromfile(f"{p}.bin", dtype=np.uint16).size) for p in (letters, digits)]
    tokenizer = load_tokenizer(tok)
    drawn = [source_of(train[i], tokenizer) for i in range(0, len(train), 3)]
    assert abs(drawn.count("letters") / len(drawn) - tokens[0] / sum(tokens)) <= 0.02


def _single_prefix_splits(root: Path, *overrides: str):
    prefix = f"data.prefixes=[{root / 'letters'}]"
    config = config_for(root, prefix, "data.split=80,10,10", *overrides)
    return build_datasets(config, 64, 16, 8)


def test_splits_are_disjoint_and_samples_are_megatron_gpt_samples(data):
    root, tok = data
    train, valid, test = _single_prefix_splits(root)
    assert [type(d).__name__ for d in (train, valid, test)] == ["GPTDataset"] * 3
    assert (len(train), len(valid), len(test)) >= (64, 16, 8)
    assert train.indices.tolist() == list(range(0, 160))  # documents 80/10/10 of 200
    assert valid.indices.tolist() == list(range(160, 180))
    assert test.indices.tolist() == list(range(180, 200))

    tokenizer = load_tokenizer(tok)
    documents = [json.loads(line)["text"] for line in open(root / "a.jsonl")]
    encoded = {i: tokenizer.tokenize(documents[i]) + [tokenizer.eod] for i in range(200)}
    for dataset in (train, valid):
        allowed = {int(i) for i in dataset.indices}
        for index in range(4):
            sample = dataset[index]
            assert sample["tokens"].shape == (SEQ,) and sample["tokens"].dtype == torch.int64
            assert torch.equal(sample["labels"][:-1], sample["tokens"][1:])
            assert torch.all(sample["loss_mask"] == 1)
            stream = sample["tokens"].tolist() + sample["labels"][-1:].tolist()
            # every run between EODs is a piece of one of this split's documents
            runs = " ".join(map(str, stream)).split(f" {tokenizer.eod} ")
            for run in filter(None, (r.strip() for r in runs)):
                ids = [int(x) for x in run.split() if int(x) != tokenizer.eod]
                assert any(_contains(encoded[d], ids) for d in allowed), ids


def _contains(haystack: list[int], needle: list[int]) -> bool:
    n = len(needle)
    return any(haystack[i : i + n] == needle for i in range(len(haystack) - n + 1))


def test_builds_in_the_single_process_group_and_without_torch_distributed(data, tmp_path):
    root, _ = data
    init_single_process()
    assert torch.distributed.is_initialized()
    train, valid, _ = _single_prefix_splits(root)
    blend = _blend(root, 300)[0]
    here = [len(train), len(valid), train[3]["tokens"].tolist(), blend_counts(blend).tolist()]

    script = (
        "import json, sys, torch\n"
        "from pathlib import Path\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "from cqk_megatron.data.builder import blend_counts\n"
        "from tests.test_datasets import _blend, _single_prefix_splits\n"
        "root, cache = Path(sys.argv[1]), 'data.cache_dir=' + sys.argv[3]\n"
        "train, valid, _ = _single_prefix_splits(root, cache)\n"
        "counts = blend_counts(_blend(root, 300, cache)[0]).tolist()\n"
        "assert not torch.distributed.is_initialized()\n"
        "print(json.dumps([len(train), len(valid), train[3]['tokens'].tolist(), counts]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", script, str(root), str(REPO), str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == here
    # the plain process built its own index caches (no process group needed)
    assert len(list(tmp_path.glob("*BlendedDataset-train-dataset_index.npy"))) == 1


def test_mock_data(tmp_path):
    config = load_config(
        None, [f"model.seq_length={SEQ}", "model.vocab_size=256", "data.mock=true"]
    )
    train, valid, test = build_datasets(config, 32, 8, 0)
    assert type(train).__name__ == "MockGPTDataset" and test is None
    sample = train[0]
    assert sample["tokens"].shape == (SEQ,)
    assert int(sample["tokens"].max()) < 256
    assert resolve_tokenizer(config).eod == 255


def test_tokenizer_comes_from_the_dataset_metadata(data, tmp_path):
    root, tok = data
    config = config_for(root, f"data.prefixes=[{root / 'letters'}]")
    assert resolve_tokenizer(config).path == str(tok)
    # moved tokenizer: the recorded ids still let training run
    moved = tmp_path / "letters"
    for suffix in (".bin", ".idx", ".meta.json"):
        shutil.copy(f"{root / 'letters'}{suffix}", f"{moved}{suffix}")
    meta = json.loads(Path(f"{moved}.meta.json").read_text())
    meta["tokenizer"]["path"] = str(tmp_path / "gone.model")
    Path(f"{moved}.meta.json").write_text(json.dumps(meta))
    config = config_for(tmp_path, f"data.prefixes=[{moved}]", "data.split=1,0,0")
    tokenizer = resolve_tokenizer(config)
    assert isinstance(tokenizer, IdsOnlyTokenizer)
    assert (tokenizer.vocab_size, tokenizer.eod) == (320, 2)
    train, _, _ = build_datasets(config, 8, 0, 0)
    assert len(train) >= 8


def test_tokenizer_vocab_must_fit_the_model(data):
    root, tok = data
    config = config_for(root, f"data.prefixes=[{root / 'letters'}]", "model.vocab_size=300")
    with pytest.raises(ConfigError) as error:
        build_datasets(config, 8, 0, 0)
    assert f"tokenizer '{tok}' has 320 tokens but model.vocab_size=300" in str(error.value)
    assert "set model.vocab_size=320" in str(error.value)


def test_dataset_made_with_another_tokenizer(data, tmp_path):
    root, _ = data
    other = train_tokenizer(
        [str(root / "a.jsonl")], tmp_path / "other", TokenizerRecipe(vocab_size=300, threads=2)
    ).model
    config = config_for(root, f"data.prefixes=[{root / 'letters'}]", f"data.tokenizer={other}")
    with pytest.raises(DataError) as error:
        build_datasets(config, 8, 0, 0)
    assert f"dataset '{root / 'letters'}' was tokenized with" in str(error.value)
    assert "(vocab 320, EOD 2)" in str(error.value) and "vocab 300" in str(error.value)


def test_bad_prefixes_weights_and_splits(data, tmp_path):
    root, _ = data
    letters = root / "letters"

    def fails(kind, pattern, *overrides, sizes=(8, 0, 0)):
        with pytest.raises(kind, match=pattern):
            build_datasets(config_for(root, *overrides), *sizes)

    fails(ConfigError, "data.prefixes is empty", "data.prefixes=[]")
    fails(DataError, "not found .*cqk data preprocess", f"data.prefixes=[{tmp_path / 'nope'}]")
    fails(ConfigError, "give the prefix without", f"data.prefixes=[{letters}.bin]")
    fails(
        ConfigError,
        "2 values for 1 data.prefixes",
        f"data.prefixes=[{letters}]",
        "data.weights=[1, 2]",
    )
    fails(ConfigError, "data.split='80;20'", f"data.prefixes=[{letters}]", "data.split=80;20")
    fails(
        ConfigError,
        "valid split no share",
        f"data.prefixes=[{letters}]",
        "data.split=1,0,0",
        sizes=(8, 4, 0),
    )
    fails(
        DataError,
        "gives the valid split 0 of the 200 documents",
        f"data.prefixes=[{letters}]",
        "data.split=999,1,0",
        sizes=(8, 4, 0),
    )

    broken = tmp_path / "broken"
    shutil.copy(f"{letters}.idx", f"{broken}.idx")
    fails(
        DataError,
        "incomplete: .*broken.idx exists but .*broken.bin does not",
        f"data.prefixes=[{broken}]",
    )
    Path(f"{broken}.bin").write_bytes(Path(f"{letters}.bin").read_bytes()[:-10])
    fails(DataError, "do not belong together", f"data.prefixes=[{broken}]")
    Path(f"{broken}.idx").write_bytes(b"garbage")
    fails(DataError, "not a readable Megatron index", f"data.prefixes=[{broken}]")
    assert np.fromfile(f"{letters}.bin", dtype=np.uint16).size > 0  # the source is untouched


def test_data_seed_fixes_the_sample_order_whatever_the_run_seed(data):
    root, _ = data

    def first_tokens(*overrides: str) -> list[list[int]]:
        train, valid, _ = _single_prefix_splits(root, *overrides)
        return [d[i]["tokens"].tolist() for d in (train, valid) for i in range(4)]

    run_seed_1 = first_tokens("seed=1")
    assert first_tokens("seed=2") != run_seed_1  # by default the run's seed shuffles
    assert first_tokens("seed=1", "data.seed=7") == first_tokens("seed=2", "data.seed=7")
    assert first_tokens("seed=1", "data.seed=1") == run_seed_1


def _files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_the_index_cache_goes_to_the_run_folder_not_the_data_folder(data, tmp_path):
    """Without data.cache_dir, Megatron would write its indices under the data prefix (a
    read-only data folder failed at start-up); they go to the run's index_cache/."""
    root, tok = data
    folder = tmp_path / "read-only-data"  # what the run may not write to
    folder.mkdir()
    for suffix in (".bin", ".idx", ".meta.json"):
        shutil.copy(f"{root / 'letters'}{suffix}", folder / f"letters{suffix}")
    before = _files_under(folder)
    config = load_config(
        None,
        [
            f"model.seq_length={SEQ}",
            "model.vocab_size=320",
            f"data.prefixes=[{folder / 'letters'}]",
            f"data.tokenizer={tok}",
            "data.split=1,0,0",
            f"log.root={tmp_path / 'runs'}",
            "name=r",
        ],
    )
    assert config.data.cache_dir is None
    train, _, _ = build_datasets(config, 8, 0, 0)
    assert len(train) >= 8
    assert _files_under(folder) == before
    cache = tmp_path / "runs" / "r" / "index_cache"
    assert len(list(cache.glob("*GPTDataset-train-shuffle_index.npy"))) == 1

"""Conversion between the Megatron model and Hugging Face: equal logits for every variant,
exact round trips, greedy generation with a KV cache, a fresh process that loads the
folder without this package, lm-evaluation-harness on a local task, and clear errors.

All on CPU in fp32 with real Megatron-Core, transformers, safetensors and sentencepiece.
Weights are perturbed away from their initialisation so that every parameter (the
coupling's zero-initialised layers included) changes the logits.
"""

from __future__ import annotations

import ast
import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import _tiny
import pytest
import torch

from cqk_megatron.cli.convert import main as cli_main
from cqk_megatron.config import VARIANTS, to_dict
from cqk_megatron.convert import (
    ConversionError,
    export_checkpoint,
    export_state_dict,
    hf_export,
    import_hf_folder,
)
from cqk_megatron.convert import hf_config as hf_config_module
from cqk_megatron.convert.hf_import import import_checkpoint
from cqk_megatron.convert.names import (
    ModelShape,
    fuse_qkv,
    megatron_param_shapes,
    split_qkv,
)
from cqk_megatron.model.gpt import build_model
from cqk_megatron.parallel.process_groups import init_single_process
from cqk_megatron.parallel.sharding import load_full_state

transformers = pytest.importorskip("transformers")
sentencepiece = pytest.importorskip("sentencepiece")

REPO = Path(__file__).resolve().parent.parent
VOCAB, SEQ, BATCH = 100, 16, 2
TOLERANCE = 1e-4
HEADS = 8
KV_LAYOUTS = {"mha": HEADS, "gqa": 4}


@pytest.fixture(scope="module", autouse=True)
def single_process():
    init_single_process()


def tiny_config(variant: str, kv_heads: int = HEADS, *overrides: str, vocab: int = VOCAB):
    return _tiny.tiny_config(
        variant,
        "attention.dt_init=0.5",
        *overrides,
        vocab=vocab,
        heads=HEADS,
        kv_heads=kv_heads,
        seq=32,
        precision="fp32",
    )


def perturbed_model(config, seed: int = 0):
    """A Megatron model whose every parameter moved away from its initial value."""
    torch.manual_seed(seed)
    model = build_model(config)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            # large query/key weights: sharp attention, so that positions (RoPE) matter
            scale = 0.2 if param.dim() < 2 or ".coupling." in name or "linear_qkv" in name else 0.05
            noise = torch.randn(param.shape, generator=generator, dtype=param.dtype)
            param.add_(noise * scale)
    return model.eval()


def full_state(model) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def tokens_for(vocab: int, batch: int = BATCH, seq: int = SEQ, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def megatron_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    return model(tokens, positions, None)


def load_hf(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        folder, trust_remote_code=True, dtype=torch.float32
    ).eval()


class Exports:
    """Exported folders by case, built once per module."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.cache: dict[tuple, tuple] = {}

    def get(self, variant: str, kv: str = "gqa", *overrides: str):
        key = (variant, kv, overrides)
        if key not in self.cache:
            config = tiny_config(variant, KV_LAYOUTS[kv], *overrides)
            model = perturbed_model(config)
            state = full_state(model)
            name = "-".join([variant, kv, *(o.replace("=", "_") for o in overrides)])
            folder = export_state_dict(state, config, self.root / name, with_tokenizer=False)
            self.cache[key] = (config, model, state, folder)
        return self.cache[key]


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> Exports:
    return Exports(tmp_path_factory.mktemp("exports"))


SENTENCES = (
    "the quick brown fox jumps over the lazy dog",
    "coupled query key dynamics evolve the pair before scoring",
    "differential attention subtracts two softmax maps",
    "a model trained on tokens learns to predict the next token",
)


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory) -> Path:
    """A small byte-fallback BPE SentencePiece model trained here on made-up text."""
    folder = tmp_path_factory.mktemp("spm")
    rng = random.Random(0)
    words = " ".join(SENTENCES).split()
    lines = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(300)]
    (folder / "corpus.txt").write_text("\n".join([*SENTENCES, *lines]) + "\n")
    sentencepiece.SentencePieceTrainer.train(
        input=str(folder / "corpus.txt"),
        model_prefix=str(folder / "spm"),
        vocab_size=320,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    return folder / "spm.model"


# --- numerics -----------------------------------------------------------------------------

LOGIT_CASES = [(variant, kv) for variant in VARIANTS for kv in KV_LAYOUTS] + [
    ("coupled", "gqa", "attention.position=post_rope"),
    ("coupled_differential", "mha", "attention.position=post_rope"),
    ("invertible", "gqa", "attention.position=post_rope"),
    ("standard", "gqa", "model.tie_embeddings=true"),
    ("standard", "gqa", "model.rotary_base=500", "model.layernorm_epsilon=0.01"),
    ("coupled_differential", "gqa", "model.rotary_base=500", "model.layernorm_epsilon=0.01"),
    ("coupled", "gqa", "model.tie_embeddings=true"),
    ("standard", "mha", "model.normalization=LayerNorm", "model.swiglu=false"),
    ("coupled", "gqa", "attention.steps=3", "attention.coupling_hidden=12"),
    ("differential", "mha", "attention.differential_norm=none"),
    ("coupled_differential", "gqa", "attention.differential_norm=small_start"),
    ("invertible_differential", "gqa", "attention.differential_norm=none"),
    ("differential", "gqa", "attention.differential_lambda_init=0.5"),
]


@pytest.mark.parametrize("case", LOGIT_CASES, ids=lambda case: "-".join(case))
def test_hf_logits_equal_megatron_logits(exports, case):
    variant, kv, *overrides = case
    config, model, _, folder = exports.get(variant, kv, *overrides)
    hf = load_hf(folder)
    native = variant == "standard" and "model.normalization=LayerNorm" not in overrides
    assert type(hf).__name__ == ("LlamaForCausalLM" if native else "CQKForCausalLM")
    assert (folder / "modeling_cqk.py").exists() != native
    tokens = tokens_for(VOCAB)
    expected = megatron_logits(model, tokens)
    with torch.no_grad():
        actual = hf(tokens).logits
    assert actual.shape == expected.shape == (BATCH, SEQ, config.model.padded_vocab_size)
    assert (actual - expected).abs().max().item() < TOLERANCE
    assert expected.std() > 0.05  # the comparison is not between two near-constant outputs


@pytest.mark.parametrize(
    "case", [("differential", "mha"), ("coupled_differential", "gqa")], ids="-".join
)
def test_hf_differential_runs_the_paired_form(exports, case, monkeypatch):
    """The exported model attends once per map with 2 head_dim values (two SDPA calls per
    layer), equals its own split form, and matches Megatron's logits (its layers run the
    paired form too, on CPU as block-causal maps)."""
    config, model, _, folder = exports.get(*case)
    hf = load_hf(folder)
    scorings = [m for m in hf.modules() if type(m).__name__ == "DifferentialScoring"]
    assert len(scorings) == config.model.num_layers
    assert {m.kernel for m in scorings} == {"paired"}
    widths = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting(q, k, v, *args, **kwargs):
        widths.append(v.shape[-1])
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    tokens = tokens_for(VOCAB)
    with torch.no_grad():
        paired = hf(tokens).logits
        for scoring in scorings:
            scoring.kernel = "split"
        widths_paired, widths[:] = list(widths), []
        split = hf(tokens).logits
    d = config.model.head_dim
    assert widths_paired == [2 * d] * 2 * config.model.num_layers
    assert widths == [d] * 4 * config.model.num_layers
    assert (paired - split).abs().max().item() < 1e-5
    assert (paired - megatron_logits(model, tokens)).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("case", LOGIT_CASES, ids=lambda case: "-".join(case))
def test_round_trip_gives_identical_tensors(exports, case):
    config, _, state, folder = exports.get(*case)
    imported, imported_config = import_hf_folder(folder)
    assert set(imported) == set(state)
    for name, tensor in state.items():
        assert imported[name].dtype == tensor.dtype
        assert torch.equal(imported[name], tensor), name
    assert to_dict(imported_config) == to_dict(config)


def test_differential_norm_survives_an_import_without_the_run_config(exports, tmp_path):
    """config.json alone (a folder whose cqk_run_config.yaml was left behind) records the
    scoring's norm, and the import builds the same model from it."""
    config, _, state, folder = exports.get(
        "coupled_differential", "gqa", "attention.differential_norm=small_start"
    )
    recorded = json.loads((folder / "config.json").read_text())["scoring_options"]
    assert recorded == {"kernel": "paired", "norm": "small_start", "lambda_init": None}
    bare = tmp_path / "bare"
    bare.mkdir()
    for item in folder.iterdir():
        if item.name != "cqk_run_config.yaml":
            (bare / item.name).write_bytes(item.read_bytes())
    imported, imported_config = import_hf_folder(bare)
    assert imported_config.attention.differential_norm == "small_start"
    assert set(imported) == set(state)
    assert all(torch.equal(imported[name], tensor) for name, tensor in state.items())


@pytest.mark.parametrize("variant", VARIANTS)
def test_param_shapes_from_config_match_megatron(exports, variant):
    config, model, _, _ = exports.get(variant, "gqa")
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert megatron_param_shapes(config) == shapes


def test_coupling_file_is_copied_verbatim(exports):
    _, _, _, folder = exports.get("coupled_differential", "gqa")
    source = (REPO / "cqk_megatron" / "variants" / "plain_math.py").read_bytes()
    assert (folder / "coupling.py").read_bytes() == source
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_cqk.CQKForCausalLM"
    for name in ("modeling_cqk.py", "configuration_cqk.py", "coupling.py"):
        tree = ast.parse((folder / name).read_text())
        imported = {
            alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
        }
        imported |= {
            "." * node.level + (node.module or "")
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
        }
        roots = {module.split(".")[0] for module in imported if not module.startswith(".")}
        assert roots <= {"__future__", "math", "collections", "torch", "transformers"}, (
            name,
            roots,
        )


# --- QKV rows ----------------------------------------------------------------------------


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2), (6, 3), (4, 1)])
def test_qkv_split_follows_megatron_grouping(heads, kv_heads):
    d, hidden = 3, 5
    shape = ModelShape(2, hidden, heads, kv_heads, d, 7, 16, True, False, False)
    group = heads // kv_heads
    # every row tagged by (query group, slot in [q_1 .. q_g, k, v], row within the head)
    tags = torch.tensor(
        [
            [g * 1000 + slot * 10 + r] * hidden
            for g in range(kv_heads)
            for slot in range(group + 2)
            for r in range(d)
        ],
        dtype=torch.float32,
    )
    q, k, v = split_qkv(tags, shape)
    for h in range(heads):
        expected = [(h // group) * 1000 + (h % group) * 10 + r for r in range(d)]
        assert q[h * d : (h + 1) * d, 0].tolist() == expected
    for j in range(kv_heads):
        assert k[j * d : (j + 1) * d, 0].tolist() == [j * 1000 + group * 10 + r for r in range(d)]
        assert v[j * d : (j + 1) * d, 0].tolist() == [
            j * 1000 + (group + 1) * 10 + r for r in range(d)
        ]
    assert torch.equal(fuse_qkv(q, k, v, shape), tags)


# --- generation ---------------------------------------------------------------------------


@torch.no_grad()
def megatron_greedy(model, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy decoding by re-running the whole sequence every step (no cache)."""
    sequence = prompt
    for _ in range(steps):
        next_token = megatron_logits(model, sequence)[:, -1].argmax(-1, keepdim=True)
        sequence = torch.cat([sequence, next_token], dim=1)
    return sequence


@pytest.mark.parametrize(
    "case",
    [
        ("standard", "gqa"),
        ("coupled", "gqa"),
        ("coupled_differential", "gqa"),
        ("coupled", "gqa", "attention.position=post_rope"),
    ],
    ids=lambda case: "-".join(case),
)
def test_greedy_generate_with_cache_equals_megatron(exports, case):
    variant, kv, *overrides = case
    _, model, _, folder = exports.get(variant, kv, *overrides)
    hf = load_hf(folder)
    prompt = tokens_for(VOCAB, batch=1, seq=5, seed=3)
    expected = megatron_greedy(model, prompt, steps=20)
    out = hf.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=20,
        do_sample=False,
        num_beams=1,
        use_cache=True,
        pad_token_id=0,
        return_dict_in_generate=True,
    )
    assert out.sequences.tolist() == expected.tolist()
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    assert cache is not None and cache.get_seq_length() == 5 + 20 - 1  # decoded with the cache


def test_incremental_decoding_matches_full_forward(exports):
    """Prefill then one token at a time through the cache, with post-RoPE coupling."""
    _, _, _, folder = exports.get("coupled_differential", "mha", "attention.position=post_rope")
    hf = load_hf(folder)
    tokens = tokens_for(VOCAB, seed=4)
    with torch.no_grad():
        full = hf(tokens).logits
        out = hf(tokens[:, :10], use_cache=True)
        steps = [out.logits]
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        for i in range(10, SEQ):
            out = hf(tokens[:, i : i + 1], cache=cache, use_cache=True)
            cache = out.cache if hasattr(out, "cache") else out.past_key_values
            steps.append(out.logits)
    assert (torch.cat(steps, dim=1) - full).abs().max().item() < 1e-5


def test_left_padded_batch_generates_like_single_prompts(exports):
    _, _, _, folder = exports.get("coupled", "gqa", "attention.position=post_rope")
    hf = load_hf(folder)
    long_prompt = tokens_for(VOCAB, batch=1, seq=7, seed=5)
    short_prompt = tokens_for(VOCAB, batch=1, seq=4, seed=6)
    batch = torch.cat(
        [long_prompt, torch.cat([torch.zeros(1, 3, dtype=torch.long), short_prompt], 1)]
    )
    mask = torch.ones_like(batch)
    mask[1, :3] = 0
    options = dict(max_new_tokens=8, do_sample=False, num_beams=1, pad_token_id=0)
    together = hf.generate(batch, attention_mask=mask, **options)
    for row, prompt in enumerate((long_prompt, short_prompt)):
        alone = hf.generate(prompt, attention_mask=torch.ones_like(prompt), **options)
        assert together[row, -8:].tolist() == alone[0, -8:].tolist()


# --- tokenizer, model card, shards --------------------------------------------------------


def test_export_with_tokenizer_card_and_shards(tmp_path, sentencepiece_model):
    config = tiny_config("coupled", 4, vocab=320)
    model = perturbed_model(config)
    folder = export_state_dict(
        full_state(model),
        config,
        tmp_path / "hf",
        tokenizer=sentencepiece_model,
        tokens_trained=123_000_000,
        validation_perplexity=21.5,
        max_shard_size="60KB",
    )
    shards = sorted(folder.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and (folder / "model.safetensors.index.json").is_file()
    assert not (folder / "model.safetensors").exists()

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    processor = sentencepiece.SentencePieceProcessor(model_file=str(sentencepiece_model))
    for text in (*SENTENCES, "  odd   spacing, ünïcode 🙂 and\nnew lines"):
        ids = processor.encode(text)
        assert tokenizer.encode(text, add_special_tokens=False) == ids
        assert tokenizer(text)["input_ids"] == ids  # no BOS added, as in Megatron's data
        assert tokenizer.decode(ids) == processor.decode(ids)
    generation = json.loads((folder / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)

    card = (folder / "README.md").read_text()
    for fact in ("`coupled`", "123M", "21.500", "CQKForCausalLM", "trust_remote_code=True"):
        assert fact in card

    hf = load_hf(folder)
    tokens = tokens_for(320)
    with torch.no_grad():
        assert (hf(tokens).logits - megatron_logits(model, tokens)).abs().max() < TOLERANCE
    state, _ = import_hf_folder(folder)
    assert all(torch.equal(state[n], p) for n, p in full_state(model).items())


def test_bfloat16_export(exports, tmp_path):
    config, model, state, _ = exports.get("coupled", "gqa")
    folder = export_state_dict(
        state, config, tmp_path / "bf16", with_tokenizer=False, dtype="bfloat16"
    )
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    imported, _ = import_hf_folder(folder)
    assert all(torch.equal(imported[n], t.to(torch.bfloat16)) for n, t in state.items())
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    assert hf.dtype == torch.bfloat16
    tokens = tokens_for(VOCAB)
    with torch.no_grad():
        logits = hf(tokens).logits.float()
    expected = megatron_logits(model, tokens)
    assert (logits - expected).abs().max() < 0.05 * expected.abs().max()


def test_exported_folder_loads_in_a_fresh_process_without_this_package(
    tmp_path, sentencepiece_model
):
    config = tiny_config("coupled_differential", 4, vocab=320)
    model = perturbed_model(config)
    folder = export_state_dict(
        full_state(model), config, tmp_path / "hf", tokenizer=sentencepiece_model
    )
    tokens = tokens_for(320)
    script = textwrap.dedent(
        f"""
        import importlib.abc, json, sys
        BLOCKED = ("cqk_megatron", "megatron")

        class Refuse(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ModuleNotFoundError(f"{{name}} is blocked in this test")
                return None

        sys.meta_path.insert(0, Refuse())
        import os
        # drop every path entry that holds this package (the repo, an editable install)
        sys.path = [p for p in sys.path if p and not os.path.isdir(os.path.join(p, "cqk_megatron"))]
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder = {str(folder)!r}
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
        with torch.no_grad():
            logits = model(torch.tensor({tokens.tolist()!r})).logits
        torch.save(logits, {str(tmp_path / "logits.pt")!r})
        leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
        print("REPORT", json.dumps({{"ids": tokenizer.encode({SENTENCES[0]!r}), "leaked": leaked,
                           "class": type(model).__name__}}))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    result = subprocess.run(
        [sys.executable, "-I", "-c", script],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("REPORT ")]
    assert len(lines) == 1, (result.stdout[-2000:], result.stderr[-2000:])
    line = lines[0]
    report = json.loads(line[len("REPORT ") :])
    assert report["leaked"] == [] and report["class"] == "CQKForCausalLM"
    processor = sentencepiece.SentencePieceProcessor(model_file=str(sentencepiece_model))
    assert report["ids"] == processor.encode(SENTENCES[0])
    logits = torch.load(tmp_path / "logits.pt")
    assert (logits - megatron_logits(model, tokens)).abs().max() < TOLERANCE


# --- native Llama import ------------------------------------------------------------------


def test_native_llama_folder_imports_with_equal_logits(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    llama_config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
        tie_word_embeddings=False,
    )
    llama = LlamaForCausalLM(llama_config).eval()
    with torch.no_grad():
        for param in llama.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    llama.save_pretrained(tmp_path / "llama")

    state, config = import_hf_folder(tmp_path / "llama")
    assert config.model.padded_vocab_size == 96 and config.model.kv_heads == 2
    assert config.model.rotary_base == 5000 and config.attention.variant == "standard"
    model = build_model(config).eval()
    load_full_state(model, state, 0, 0, 1, gated_linear_unit=True)
    tokens = tokens_for(96)
    with torch.no_grad():
        expected = llama(tokens).logits
    assert (megatron_logits(model, tokens) - expected).abs().max() < TOLERANCE


# --- lm-evaluation-harness ----------------------------------------------------------------

MC_ROWS = [
    {"question": "the quick brown", "choices": ["fox", "dog"], "answer": 0},
    {"question": "the lazy", "choices": ["dog", "fox", "model"], "answer": 0},
    {"question": "coupled query", "choices": ["key", "token"], "answer": 0},
    {"question": "differential", "choices": ["attention", "train"], "answer": 0},
    {"question": "jumps over the", "choices": ["lazy", "dynamics"], "answer": 0},
]


def test_lm_eval_harness_runs_a_local_task(tmp_path, sentencepiece_model, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    pytest.importorskip("accelerate")  # lm-eval's hf model needs it
    from lm_eval.tasks import TaskManager

    config = tiny_config("coupled", 4, vocab=320)
    model = perturbed_model(config)
    folder = export_state_dict(
        full_state(model), config, tmp_path / "hf", tokenizer=sentencepiece_model
    )
    data = tmp_path / "tiny_mc.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in MC_ROWS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny_mc.yaml").write_text(
        textwrap.dedent(
            f"""
            task: cqk_tiny_mc
            dataset_path: json
            dataset_kwargs:
              data_files:
                test: {data}
            test_split: test
            output_type: multiple_choice
            doc_to_text: "{{{{question}}}}"
            doc_to_choice: "{{{{choices}}}}"
            doc_to_target: "{{{{answer}}}}"
            metric_list:
              - metric: acc
                aggregation: mean
                higher_is_better: true
            """
        )
    )
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # the task's data is the local file
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    results = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={folder},trust_remote_code=True,dtype=float32",
        tasks=["cqk_tiny_mc"],
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        device="cpu",
        batch_size=2,
        log_samples=True,
    )
    # every choice's log-likelihood as the Megatron model computes it
    processor = sentencepiece.SentencePieceProcessor(model_file=str(sentencepiece_model))
    correct = []
    for sample in results["samples"]["cqk_tiny_mc"]:
        scores = []
        requests = zip(sample["arguments"], sample["resps"], strict=True)
        for (context, continuation), response in requests:
            context_ids = processor.encode(context)
            whole = processor.encode(context + continuation)
            target = whole[len(context_ids) :]
            logits = megatron_logits(model, torch.tensor([whole[:-1]]))[0, -len(target) :]
            ours = logits.log_softmax(-1).gather(1, torch.tensor(target)[:, None]).sum().item()
            assert abs(response[0][0] - ours) < TOLERANCE
            scores.append(ours)
        correct.append(float(max(range(len(scores)), key=scores.__getitem__) == sample["target"]))
    accuracy = results["results"]["cqk_tiny_mc"]["acc,none"]
    assert accuracy == pytest.approx(sum(correct) / len(correct))


# --- bad input ----------------------------------------------------------------------------


def test_existing_output_folder_is_refused_unless_overwrite(exports, tmp_path):
    config, _, state, _ = exports.get("coupled", "gqa")
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(ConversionError, match="already exists.*--force"):
        export_state_dict(state, config, target, with_tokenizer=False)
    assert (target / "keep.txt").read_text() == "mine"
    # overwrite replaces only what an export wrote: not a file of someone else's
    with pytest.raises(ConversionError, match=r"1 file\(s\) that no earlier .*keep.txt"):
        export_state_dict(state, config, target, with_tokenizer=False, overwrite=True)
    (target / "keep.txt").unlink()
    export_state_dict(state, config, target, with_tokenizer=False, overwrite=True)
    export_state_dict(state, config, target, with_tokenizer=False, overwrite=True)  # its own
    assert (target / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging left behind


def test_failed_export_leaves_nothing_behind(exports, tmp_path, monkeypatch):
    config, _, state, _ = exports.get("coupled", "gqa")

    def disk_full(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(hf_export, "save_weights", disk_full)
    with pytest.raises(OSError, match="No space"):
        export_state_dict(state, config, tmp_path / "out", with_tokenizer=False)
    assert list(tmp_path.iterdir()) == []


def test_variant_unknown_to_the_exporter_is_refused(exports, tmp_path, monkeypatch):
    config, _, state, _ = exports.get("invertible", "gqa")
    monkeypatch.setattr(hf_config_module, "EXPORTABLE_COUPLINGS", ("none", "hamiltonian"))
    with pytest.raises(ConversionError, match="'invertible'.*unknown to the Hugging Face exporter"):
        export_state_dict(state, config, tmp_path / "out", with_tokenizer=False)
    assert not (tmp_path / "out").exists()


def test_missing_or_wrong_tokenizer_is_refused(exports, tmp_path, sentencepiece_model):
    config, _, state, _ = exports.get("coupled", "gqa")
    with pytest.raises(ConversionError, match="data.tokenizer is unset.*--no-tokenizer"):
        export_state_dict(state, config, tmp_path / "a")
    config_with_gone = tiny_config("coupled", 4, f"data.tokenizer={tmp_path / 'gone.model'}")
    with pytest.raises(ConversionError, match="data.tokenizer=.*gone.model.*does not exist"):
        export_state_dict(state, config_with_gone, tmp_path / "b")
    with pytest.raises(ConversionError, match="has 320 tokens but model.vocab_size is 100"):
        export_state_dict(state, config, tmp_path / "c", tokenizer=sentencepiece_model)
    assert list(tmp_path.iterdir()) == []


def test_state_dict_that_does_not_fit_the_config_is_refused(exports, tmp_path):
    config, _, state, _ = exports.get("coupled", "gqa")
    missing = {k: v for k, v in state.items() if ".coupling." not in k}
    with pytest.raises(ConversionError, match="missing 8 tensor"):
        export_state_dict(missing, config, tmp_path / "a", with_tokenizer=False)
    standard_config = tiny_config("standard", 4)
    with pytest.raises(ConversionError, match="unexpected tensor.*coupling"):
        export_state_dict(state, standard_config, tmp_path / "b", with_tokenizer=False)
    mha_config = tiny_config("coupled", HEADS)
    with pytest.raises(ConversionError, match="wrong shape.*linear_qkv"):
        export_state_dict(state, mha_config, tmp_path / "c", with_tokenizer=False)


def test_folders_that_are_not_checkpoints_are_refused(tmp_path):
    with pytest.raises(ConversionError, match="not a run checkpoint"):
        export_checkpoint(tmp_path, tmp_path / "out")
    half = tmp_path / "iter_0000010.tmp"
    (half / "model").mkdir(parents=True)
    (half / "model" / "__0_0.distcp").write_bytes(b"partial")
    with pytest.raises(ConversionError, match="half-written.*manifest.json"):
        export_checkpoint(half, tmp_path / "out")
    with pytest.raises(ConversionError, match="latest' names 'not_there', which does not exist"):
        (tmp_path / "latest").write_text("not_there\n")
        export_checkpoint(tmp_path, tmp_path / "out")
    complete = tmp_path / "iter_0000020"
    complete.mkdir()
    (complete / "manifest.json").write_text("{}")
    with pytest.raises(ConversionError, match="no config.yaml"):
        export_checkpoint(complete, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_cli_exports_a_run_checkpoint_and_imports_it_back(exports, tmp_path):
    from cqk_megatron.convert.checkpoint_io import read_full_state_dict, write_full_state_dict

    config, model, state, _ = exports.get("coupled_differential", "gqa")
    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    write_full_state_dict(state, config, checkpoints / "iter_0000042")
    (checkpoints / "latest").write_text("iter_0000042\n")

    out = tmp_path / "hf"
    assert cli_main(["export", str(tmp_path / "run"), str(out), "--no-tokenizer"]) == 0
    assert "| Iteration | 42 |" in (out / "README.md").read_text()
    tokens = tokens_for(VOCAB)
    with torch.no_grad():
        hf_logits = load_hf(out)(tokens).logits
    assert (hf_logits - megatron_logits(model, tokens)).abs().max() < TOLERANCE

    assert cli_main(["import", str(out), str(tmp_path / "imported")]) == 0
    back = read_full_state_dict(tmp_path / "imported", config)
    assert set(back) == set(state) and all(torch.equal(back[n], t) for n, t in state.items())


def _save_under_tp2_and_pp2(rank: int, world_size: int, port: int, root: str) -> None:
    """Worker: the same full weights saved by the engine under TP=2 and under PP=2."""
    from megatron.core import parallel_state

    from cqk_megatron.parallel.process_groups import (
        DistEnv,
        init_model_parallel,
        init_process_group,
    )
    from cqk_megatron.training.checkpoint import save_weights

    init_process_group(DistEnv(rank, rank, world_size, "127.0.0.1", port))
    state = torch.load(Path(root) / "full.pt")
    for tp, pp in ((2, 1), (1, 2)):
        layout = [f"parallel.tensor_parallel={tp}", f"parallel.pipeline_parallel={pp}"]
        config = tiny_config("coupled_differential", 4, *layout)
        init_model_parallel(config)
        model = build_model(config)
        offset = parallel_state.get_pipeline_model_parallel_rank() * (2 // pp)
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        load_full_state(model, state, offset, tp_rank, tp, gated_linear_unit=True)
        save_weights(Path(root) / f"tp{tp}pp{pp}", model, config)


def test_checkpoints_saved_under_tp2_and_pp2_export_equal_logits(exports, tmp_path):
    from _multiproc import run_ranks

    _, model, state, _ = exports.get("coupled_differential", "gqa")
    torch.save(state, tmp_path / "full.pt")
    run_ranks(_save_under_tp2_and_pp2, 2, str(tmp_path))
    tokens = tokens_for(VOCAB)
    expected = megatron_logits(model, tokens)
    for layout in ("tp2pp1", "tp1pp2"):
        folder = export_checkpoint(
            tmp_path / layout, tmp_path / f"hf-{layout}", with_tokenizer=False
        )
        imported, config = import_hf_folder(folder)
        assert (config.parallel.tensor_parallel, config.parallel.pipeline_parallel) != (1, 1)
        assert all(torch.equal(imported[n], t) for n, t in state.items()), layout
        with torch.no_grad():
            assert (load_hf(folder)(tokens).logits - expected).abs().max() < TOLERANCE, layout


def test_import_refuses_what_it_cannot_read(tmp_path, exports):
    with pytest.raises(ConversionError, match="is not a folder"):
        import_hf_folder(tmp_path / "nothing")
    with pytest.raises(ConversionError, match="not a Hugging Face model folder"):
        import_hf_folder(tmp_path)
    _, _, _, folder = exports.get("standard", "gqa")
    config = json.loads((folder / "config.json").read_text())
    for edit, message in (
        ({"model_type": "mistral"}, "model_type='mistral' cannot be imported"),
        ({"hidden_size": 128}, "disagree.*hidden_size=128"),
    ):
        broken = tmp_path / f"broken-{next(iter(edit))}"
        broken.mkdir()
        for item in folder.iterdir():
            (broken / item.name).write_bytes(item.read_bytes())
        (broken / "config.json").write_text(json.dumps({**config, **edit}))
        with pytest.raises(ConversionError, match=message):
            import_hf_folder(broken)
    biased = tmp_path / "biased"
    biased.mkdir()
    for item in folder.iterdir():
        if item.name != "cqk_run_config.yaml":  # a foreign Llama folder
            (biased / item.name).write_bytes(item.read_bytes())
    (biased / "config.json").write_text(json.dumps({**config, "attention_bias": True}))
    with pytest.raises(ConversionError, match="attention_bias=True has no counterpart"):
        import_hf_folder(biased)
    existing = tmp_path / "ckpt"
    existing.mkdir()
    with pytest.raises(ConversionError, match="already exists"):
        import_checkpoint(folder, existing)


def test_cli_reports_errors_with_exit_code_2(tmp_path, capsys):
    assert cli_main(["export", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "not a run checkpoint" in capsys.readouterr().err
    assert cli_main(["import", str(tmp_path), str(tmp_path / "ckpt")]) == 2
    assert "not a Hugging Face model folder" in capsys.readouterr().err
    (tmp_path / "taken").mkdir()
    assert cli_main(["export", str(tmp_path), str(tmp_path / "taken")]) == 2
    assert "--force" in capsys.readouterr().err


def test_exported_safetensors_weights_are_readable_by_the_team(tmp_path):
    """safetensors' ``save_file`` makes its files 0600 whatever the umask (it renames its
    own temporary): HF exports must still come out with the umask's mode."""
    import stat

    from cqk_megatron.convert.safetensors_io import save_weights

    previous = os.umask(0o022)
    try:
        single = save_weights({"w": torch.ones(4, 4)}, tmp_path)
        (tmp_path / "sharded").mkdir()
        sharded = save_weights(
            {"a": torch.ones(64, 64), "b": torch.ones(64, 64)}, tmp_path / "sharded", 20000
        )
    finally:
        os.umask(previous)
    paths = [tmp_path / n for n in single] + [tmp_path / "sharded" / n for n in sharded]
    assert len(paths) == 4  # one file; two shards and their index
    for path in paths:
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, (path, oct(path.stat().st_mode))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "sharded"]

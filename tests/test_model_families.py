"""The GPT-2 model family (learned absolute positions, LayerNorm, exact GELU MLP, biases)
beside the Llama one: config validation, TP/PP equivalence with one rank, and Hugging Face
export (native ``GPT2LMHeadModel`` for standard attention, ``CQKForCausalLM`` otherwise)
with logits equal to the Megatron model's."""

from __future__ import annotations

import pytest
import torch
from test_convert import (
    BATCH,
    SEQ,
    TOLERANCE,
    VOCAB,
    Exports,
    load_hf,
    megatron_logits,
    tokens_for,
)
from test_parallel_equivalence import TINY, failures, run_layout

from cqk_megatron.config import ConfigError, load_config, to_dict, validate
from cqk_megatron.convert import import_hf_folder
from cqk_megatron.parallel.process_groups import init_single_process

GPT2 = [*TINY, "model.family=gpt2", "model.num_attention_heads=4"]


@pytest.fixture(scope="module", autouse=True)
def single_process():
    init_single_process()


# --- config -------------------------------------------------------------------------------


def test_family_fills_in_the_architecture_fields():
    m = validate(load_config(None, ["model.family=gpt2"])).model
    assert (m.normalization, m.swiglu) == ("LayerNorm", False)
    assert (m.position_embedding_type, m.add_bias_linear) == ("learned_absolute", True)
    assert m.architecture_family == "gpt2" and m.ffn_size == 4 * m.hidden_size
    assert load_config(None, []).model.architecture_family == "llama"
    custom = load_config(None, ["model.add_bias_linear=true"]).model
    assert custom.architecture_family == "custom"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.family=gpt3"], "model.family='gpt3' is unknown"),
        (
            ["model.family=gpt2", "model.normalization=RMSNorm"],
            "model.normalization='RMSNorm' contradicts model.family='gpt2'",
        ),
        (
            ["model.position_embedding_type=alibi"],
            "model.position_embedding_type='alibi' is unknown",
        ),
        (
            ["model.family=gpt2", "attention.coupling=hamiltonian", "attention.position=post_rope"],
            "attention.position=post_rope needs RoPE",
        ),
    ],
)
def test_bad_family_settings_name_the_field_and_fix(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        validate(load_config(None, overrides))


def test_gpt2_model_files_are_gpt2_family():
    from cqk_megatron.bench.overhead import count_variant_parameters
    from cqk_megatron.config import CONFIGS_DIR

    counts = {}
    for size in ("60m", "150m", "350m"):
        config = validate(load_config(CONFIGS_DIR / f"models/gpt2-{size}.yaml"))
        assert config.model.architecture_family == "gpt2"
        counts[size] = count_variant_parameters(config, "standard")
    assert 50e6 < counts["60m"] < 70e6 and 130e6 < counts["150m"] < 170e6
    assert 330e6 < counts["350m"] < 400e6


# --- TP / PP ------------------------------------------------------------------------------


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_gpt2_family_matches_single_process(tmp_path, tp, pp):
    variants = ["standard", "coupled"]
    results = run_layout(tmp_path, tp, pp, variants, GPT2)
    assert failures(results, variants) == []
    # the family is really there: per layer 2 norms x (weight, bias), QKV, proj, fc1, fc2
    # x (weight, bias) = 12 tensors (+ 4 of the coupling); the first stage holds the word
    # and position tables, the last the final norm (2) and the output layer
    layers = 4 // pp
    for rank, by_variant in results.items():
        first, last = rank // tp == 0, rank // tp == pp - 1
        expected = 12 * layers + 2 * first + 3 * last
        assert by_variant["standard"]["num_params"] == expected
        assert by_variant["coupled"]["num_params"] == expected + 4 * layers


# --- Hugging Face export ------------------------------------------------------------------

EXPORT_CASES = [
    ("standard", "mha", "model.family=gpt2"),
    ("standard", "mha", "model.family=gpt2", "model.tie_embeddings=true"),
    ("standard", "gqa", "model.family=gpt2"),  # no GQA in GPT-2: remote code
    ("coupled", "mha", "model.family=gpt2"),
    ("coupled", "gqa", "model.family=gpt2", "model.tie_embeddings=true"),
    ("coupled_euler", "gqa", "model.family=gpt2"),
    ("mlp_only", "mha", "model.family=gpt2"),
    ("invertible", "gqa", "model.family=gpt2"),
    ("differential", "mha", "model.family=gpt2"),
    ("coupled_differential", "gqa", "model.family=gpt2"),
    ("standard", "gqa", "model.add_bias_linear=true"),  # Llama with biases: remote code
    ("coupled", "gqa", "model.add_bias_linear=true", "attention.position=post_rope"),
    ("coupled", "mha", "model.position_embedding_type=learned_absolute"),
]


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> Exports:
    return Exports(tmp_path_factory.mktemp("family_exports"))


@pytest.mark.parametrize("case", EXPORT_CASES, ids=lambda case: "-".join(case))
def test_hf_logits_equal_megatron_logits(exports, case):
    variant, kv, *overrides = case
    config, model, _, folder = exports.get(variant, kv, *overrides)
    hf = load_hf(folder)
    native = variant == "standard" and kv == "mha" and "model.family=gpt2" in overrides
    assert type(hf).__name__ == ("GPT2LMHeadModel" if native else "CQKForCausalLM")
    assert (folder / "modeling_cqk.py").exists() != native
    tokens = tokens_for(VOCAB)
    expected = megatron_logits(model, tokens)
    with torch.no_grad():
        actual = hf(tokens).logits
    assert actual.shape == expected.shape == (BATCH, SEQ, config.model.padded_vocab_size)
    assert (actual - expected).abs().max().item() < TOLERANCE
    assert expected.std() > 0.05  # not two near-constant outputs
    # the positions and the biases are in the computation: moving them moves the logits
    with torch.no_grad():
        table = hf.transformer.wpe if native else hf.model.embed_positions
        if table is not None:
            table.weight.add_(torch.randn_like(table.weight))  # (LayerNorm absorbs a shift)
            assert (hf(tokens).logits - expected).abs().max().item() > 10 * TOLERANCE


@pytest.mark.parametrize("case", EXPORT_CASES, ids=lambda case: "-".join(case))
def test_round_trip_gives_identical_tensors(exports, case):
    config, _, state, folder = exports.get(*case)
    imported, imported_config = import_hf_folder(folder)
    assert set(imported) == set(state)
    for name, tensor in state.items():
        assert torch.equal(imported[name], tensor), name
    assert to_dict(imported_config) == to_dict(config)


def test_foreign_gpt2_folder_imports_and_gelu_new_is_refused(exports, tmp_path):
    import json

    from cqk_megatron.convert import ConversionError

    config, _, state, folder = exports.get("standard", "mha", "model.family=gpt2")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    for item in folder.iterdir():
        if item.name != "cqk_run_config.yaml":  # as transformers would write it
            (foreign / item.name).write_bytes(item.read_bytes())
    imported, imported_config = import_hf_folder(foreign)
    assert imported_config.model.architecture_family == "gpt2"
    for key in ("num_layers", "hidden_size", "num_attention_heads", "ffn_size", "seq_length"):
        assert getattr(imported_config.model, key) == getattr(config.model, key), key
    assert set(imported) == set(state)
    assert all(torch.equal(imported[name], tensor) for name, tensor in state.items())
    hf = json.loads((foreign / "config.json").read_text())
    (foreign / "config.json").write_text(json.dumps({**hf, "activation_function": "gelu_new"}))
    with pytest.raises(ConversionError, match="'gelu_new' is the tanh approximation"):
        import_hf_folder(foreign)


# --- FLOPs and parameter counts -----------------------------------------------------------


@pytest.mark.parametrize("variant", ["standard", "coupled", "differential"])
def test_gpt2_flops_and_stage_parameters_match_the_built_model(variant):
    import itertools

    from test_perf import MODEL_FLOPS_SDPA, counted_flops_per_token, tiny

    from cqk_megatron.model.gpt import build_model, count_parameters
    from cqk_megatron.model.params import stage_parameters
    from cqk_megatron.perf.flops import flops_per_token

    config = tiny(variant, "model.family=gpt2")
    model = build_model(config)
    forward = counted_flops_per_token(model, MODEL_FLOPS_SDPA, backward=False)
    assert flops_per_token(config, training=False) == pytest.approx(forward, rel=0.05)
    half = tiny(variant, "model.family=gpt2", "model.num_layers=1")  # a 2-layer model over pp=2
    for first, last in itertools.product([True, False], repeat=2):
        with torch.device("meta"):
            built = count_parameters(build_model(half, pre_process=first, post_process=last))
        assert stage_parameters(config, tp=1, pp=2, first=first, last=last) == built


# --- cqk-repro in the GPT-2 family --------------------------------------------------------


def test_repro_runs_in_the_gpt2_family(tmp_path):
    from cqk_megatron.repro.configs import build_reproduction
    from cqk_megatron.repro.data import DataChoice
    from cqk_megatron.repro.presets import PRESETS, ReproError

    data = DataChoice(tmp_path / "d_text_document", tmp_path / "t.model", 700, "test data")
    preset = PRESETS["cpu-tiny"]
    reproduction = build_reproduction(
        preset, ["standard", "coupled"], [0], 4096, data, tmp_path, 1, [], False, "gpt2"
    )
    for run in reproduction.runs:
        m = run.config.model
        assert m.architecture_family == "gpt2" and m.ffn_size == 4 * m.hidden_size
        assert run.name == f"cpu-tiny-gpt2-{run.variant}-s0"
    llama = build_reproduction(preset, ["coupled"], [0], 4096, data, tmp_path, 1, [], False)
    assert llama.runs[0].config.model.architecture_family == "llama"
    with pytest.raises(ReproError, match="model.family is set by the command; use --family"):
        build_reproduction(
            preset, ["coupled"], [0], 4096, data, tmp_path, 1, ["model.family=gpt2"], False
        )


def test_repro_trains_the_gpt2_family(tmp_path, capsys):
    from test_repro import FAST

    from cqk_megatron.cli.repro import main
    from data_tools.demo_corpus import DemoSettings, build_demo

    prefix = build_demo(
        tmp_path / "data", DemoSettings(max_bytes=150_000, vocab_size=700), progress=False
    ).prefix
    argv = ["--preset", "cpu-tiny", "--data", str(prefix), "--tokens", str(2 * 16 * 128)]
    argv += ["--variants", "coupled", "--family", "gpt2", "--out", str(tmp_path / "out")]
    assert main([*argv, "--quiet", *FAST]) == 0, capsys.readouterr().err
    saved = load_config(tmp_path / "out/runs/cpu-tiny-gpt2-coupled-s0/config.yaml")
    assert saved.model.architecture_family == "gpt2"
    assert "cpu-tiny-gpt2-coupled-s0" in (tmp_path / "out/comparison.md").read_text()

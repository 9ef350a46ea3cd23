"""Config files, loading (includes, overrides, types) and every ``validate()`` rule."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from cqk_megatron.config import (
    CONFIGS_DIR,
    VARIANTS,
    AttentionConfig,
    ConfigError,
    ModelConfig,
    RunConfig,
    StatedHardware,
    apply_overrides,
    config_errors,
    from_dict,
    hardware_errors,
    load_config,
    load_yaml_dict,
    save_config,
    to_dict,
    validate,
)

MODELS_DIR = CONFIGS_DIR / "models"
VARIANTS_DIR = CONFIGS_DIR / "variants"

# model -> (world size, tensor parallel, pipeline parallel) layouts it is meant to run at.
LAYOUTS: dict[str, list[tuple[int, int, int]]] = {
    "60m": [(1, 1, 1), (8, 1, 1), (8, 2, 1)],
    "150m": [(1, 1, 1), (8, 2, 1)],
    "350m": [(8, 1, 1), (8, 2, 1), (16, 2, 2)],
    "1b": [(8, 2, 1), (16, 2, 2)],
    "3b": [(16, 4, 1), (32, 4, 2), (32, 2, 4)],
    "7b": [(32, 8, 4), (64, 8, 4)],
}
# Exact shapes the model files must have (num_query_groups None: multi-head attention).
MODEL_DIMS = {
    "60m": dict(
        num_layers=8,
        hidden_size=512,
        num_attention_heads=8,
        num_query_groups=None,
        ffn_hidden_size=1408,
        seq_length=1024,
    ),
    "150m": dict(
        num_layers=12,
        hidden_size=768,
        num_attention_heads=12,
        num_query_groups=None,
        ffn_hidden_size=2304,
        seq_length=1024,
    ),
    "350m": dict(
        num_layers=24,
        hidden_size=1024,
        num_attention_heads=16,
        num_query_groups=None,
        ffn_hidden_size=2816,
        seq_length=2048,
    ),
    "1b": dict(
        num_layers=16,
        hidden_size=2048,
        num_attention_heads=16,
        num_query_groups=None,
        ffn_hidden_size=5632,
        seq_length=2048,
    ),
    "3b": dict(
        num_layers=28,
        hidden_size=3072,
        num_attention_heads=24,
        num_query_groups=8,
        ffn_hidden_size=8192,
        seq_length=4096,
    ),
    "7b": dict(
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=14336,
        seq_length=4096,
    ),
}


def layout_overrides(world: int, tp: int, pp: int) -> list[str]:
    """Parallel layout plus a global batch that every data-parallel size here divides."""
    return [
        f"parallel.world_size={world}",
        f"parallel.tensor_parallel={tp}",
        f"parallel.pipeline_parallel={pp}",
        "train.micro_batch_size=1",
        "train.global_batch_size=64",
    ]


def param_count(m: ModelConfig) -> int:
    h, kv = m.hidden_size, m.kv_heads * m.head_dim
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * m.ffn_size + 2 * h
    return m.num_layers * per_layer + 2 * m.padded_vocab_size * h + h


def assert_invalid(config: RunConfig, *fields: str, world_size: int | None = None) -> str:
    """``validate`` refuses ``config`` with a message naming every one of ``fields``."""
    with pytest.raises(ConfigError) as info:
        validate(config, world_size)
    message = str(info.value)
    for name in fields:
        assert name in message, f"{name!r} not named in: {message}"
    return message


def cfg(*overrides: str) -> RunConfig:
    return load_config(None, list(overrides))


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# ---------------------------------------------------------------------------------------
# shipped config files
# ---------------------------------------------------------------------------------------


def test_model_files_are_the_expected_set_and_variants_live_in_the_registry_only():
    assert {p.stem for p in MODELS_DIR.glob("*.yaml")} >= set(MODEL_DIMS)
    assert not VARIANTS_DIR.exists()  # include: variants/NAME.yaml reads the registry


@pytest.mark.parametrize("name", sorted(MODEL_DIMS))
def test_model_file_has_only_model_section_with_exact_dims(name):
    path = MODELS_DIR / f"{name}.yaml"
    assert set(yaml.safe_load(path.read_text())) == {"model"}
    m = load_config(path).model
    for key, value in MODEL_DIMS[name].items():
        assert getattr(m, key) == value, (name, key)
    assert m.vocab_size == 32000 and m.padded_vocab_size == 32000
    assert m.normalization == "RMSNorm" and m.swiglu and not m.tie_embeddings


@pytest.mark.parametrize("name", sorted(MODEL_DIMS))
def test_model_file_comment_states_its_parameter_count(name):
    path = MODELS_DIR / f"{name}.yaml"
    first_line = path.read_text().splitlines()[0]
    assert first_line.startswith("#")
    stated = re.search(r"\(([\d,]+) with", first_line)
    assert stated, "first line must give the exact count: '(N with ...'"
    assert int(stated.group(1).replace(",", "")) == param_count(load_config(path).model)


def test_60m_is_about_58_5m_and_7b_about_7_2b():
    assert round(param_count(load_config(MODELS_DIR / "60m.yaml").model) / 1e6, 1) == 58.5
    assert round(param_count(load_config(MODELS_DIR / "7b.yaml").model) / 1e9, 1) == 7.2


@pytest.mark.parametrize(
    "name,layout", [(n, lay) for n, lays in sorted(LAYOUTS.items()) for lay in lays]
)
def test_model_file_validates_at_its_layouts(name, layout):
    config = load_config(MODELS_DIR / f"{name}.yaml", layout_overrides(*layout))
    assert validate(config) is config


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_variant_include_is_the_registrys_preset(tmp_path, variant):
    for text in (f"include: variants/{variant}.yaml", f"include: [../variants/{variant}.yaml]"):
        run = write(tmp_path / "runs" / "run.yaml", f"{text}\nname: r\n")
        attention = load_config(run).attention
        assert (attention.coupling, attention.scoring) == VARIANTS[variant]
        assert validate(load_config(run)).attention.variant == variant
    # as a --config of its own, as the files were
    assert load_config(VARIANTS_DIR / f"{variant}.yaml").attention.variant == variant


def test_a_variant_registered_from_code_is_includable_and_a_file_wins(tmp_path, monkeypatch):
    from cqk_megatron.variants import registry

    monkeypatch.setitem(registry._VARIANTS, "euler_diff_coded", ("euler", "differential"))
    run = write(tmp_path / "run.yaml", "include: variants/euler_diff_coded.yaml\n")
    assert load_config(run).attention.variant == "euler_diff_coded"
    write(tmp_path / "variants" / "coupled.yaml", "attention: {coupling: euler}\n")
    run = write(tmp_path / "run.yaml", "include: variants/coupled.yaml\n")
    assert load_config(run).attention.coupling == "euler"  # the file next to it, not the preset
    missing = write(tmp_path / "bad.yaml", "include: variants/nonesuch.yaml\n")
    with pytest.raises(ConfigError, match="registered preset"):
        load_config(missing)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("name", sorted(MODEL_DIMS))
def test_every_model_with_every_variant_validates(tmp_path, name, variant):
    run = write(
        tmp_path / "run.yaml",
        f"include: [models/{name}.yaml, variants/{variant}.yaml]\nname: {name}-{variant}\n",
    )
    differential = VARIANTS[variant][1] == "differential"
    # 7b at tp=8 holds one key/value head per rank: differential pairs need tp <= 4.
    layout = (32, 4, 8) if name == "7b" and differential else LAYOUTS[name][-1]
    config = load_config(run, layout_overrides(*layout))
    assert validate(config).attention.variant == variant
    assert config.model == load_config(MODELS_DIR / f"{name}.yaml").model


@pytest.mark.parametrize("variant", [v for v, (_, s) in VARIANTS.items() if s == "differential"])
def test_7b_differential_is_refused_at_tp8(variant):
    config = load_config(MODELS_DIR / "7b.yaml", layout_overrides(32, 8, 4))
    config.attention = load_config(VARIANTS_DIR / f"{variant}.yaml").attention
    assert_invalid(config, "attention.scoring=differential", "model.num_query_groups=8")


# ---------------------------------------------------------------------------------------
# includes, overrides, types
# ---------------------------------------------------------------------------------------


def test_include_merge_order(tmp_path):
    write(tmp_path / "first.yaml", "model:\n  num_layers: 2\n  hidden_size: 64\nseed: 1\n")
    write(tmp_path / "second.yaml", "model:\n  num_layers: 3\nattention:\n  steps: 2\nseed: 2\n")
    run = write(
        tmp_path / "run.yaml",
        "include: [first.yaml, second.yaml]\nseed: 3\nattention:\n  dt_init: 0.5\n",
    )
    config = load_config(run)
    assert config.model.num_layers == 3  # the later include wins
    assert config.model.hidden_size == 64  # deep merge keeps what later files do not set
    assert config.attention.steps == 2
    assert config.attention.dt_init == 0.5
    assert config.seed == 3  # the file's own keys win over its includes
    assert load_config(run, ["seed=4", "model.num_layers=5"]).seed == 4  # overrides win last
    assert load_config(run, ["model.num_layers=5"]).model.hidden_size == 64


def test_include_of_shipped_model_and_variant_with_own_keys(tmp_path):
    run = write(
        tmp_path / "run.yaml",
        "include:\n  - models/60m.yaml\n  - variants/coupled.yaml\n"
        "name: small\nmodel:\n  seq_length: 256\nattention:\n  steps: 3\n"
        "train:\n  global_batch_size: 16\n",
    )
    config = load_config(run)
    assert config.name == "small"
    assert config.model.seq_length == 256  # own key beats the included model
    assert config.model.hidden_size == 512 and config.model.num_layers == 8
    assert (config.attention.coupling, config.attention.scoring) == ("hamiltonian", "standard")
    assert config.attention.steps == 3
    assert config.train.global_batch_size == 16
    assert validate(config, world_size=8) is config


def test_include_single_string_nested_and_local_first(tmp_path):
    # a file next to the including one beats the one under configs/
    write(tmp_path / "models" / "60m.yaml", "model:\n  num_layers: 6\n")
    write(tmp_path / "mid.yaml", "include: models/60m.yaml\nmodel:\n  hidden_size: 96\n")
    run = write(tmp_path / "sub" / "run.yaml", "include: ../mid.yaml\nmodel:\n  num_layers: 7\n")
    data = load_yaml_dict(tmp_path / "mid.yaml")
    assert data == {"model": {"num_layers": 6, "hidden_size": 96}}
    config = load_config(run)
    assert (config.model.num_layers, config.model.hidden_size) == (7, 96)


def test_diamond_include_is_not_a_cycle(tmp_path):
    write(tmp_path / "base.yaml", "seed: 5\n")
    write(tmp_path / "a.yaml", "include: base.yaml\n")
    write(tmp_path / "b.yaml", "include: base.yaml\n")
    assert load_config(write(tmp_path / "run.yaml", "include: [a.yaml, b.yaml]\n")).seed == 5


def test_empty_file_and_no_file_give_defaults(tmp_path):
    assert load_config(write(tmp_path / "empty.yaml", "")) == RunConfig()
    assert load_config() == RunConfig()
    assert validate(RunConfig()) == RunConfig()


@pytest.mark.parametrize(
    "override,get,expected",
    [
        ("model.num_layers=6", lambda c: c.model.num_layers, 6),
        ("attention.dt_init=0.05", lambda c: c.attention.dt_init, 0.05),
        ("attention.dt_init=1", lambda c: c.attention.dt_init, 1.0),  # int -> float
        ("parallel.sequence_parallel=true", lambda c: c.parallel.sequence_parallel, True),
        ("model.swiglu=False", lambda c: c.model.swiglu, False),
        ("model.num_query_groups=null", lambda c: c.model.num_query_groups, None),
        ("model.num_query_groups=", lambda c: c.model.num_query_groups, None),
        ("parallel.virtual_pipeline=~", lambda c: c.parallel.virtual_pipeline, None),
        ("model.num_query_groups=2", lambda c: c.model.num_query_groups, 2),
        ("name=my-run", lambda c: c.name, "my-run"),
        ("name='123'", lambda c: c.name, "123"),
        ("name=a=b", lambda c: c.name, "a=b"),  # only the first '=' splits
        (" train.precision = bf16", lambda c: c.train.precision, "bf16"),
        ("model.layernorm_epsilon=1.0e-6", lambda c: c.model.layernorm_epsilon, 1e-6),
    ],
)
def test_override_parses_types(override, get, expected):
    value = get(cfg(override))
    assert value == expected and type(value) is type(expected)


def test_overrides_apply_in_order():
    data = {"model": {"num_layers": 2, "hidden_size": 64}}
    out = apply_overrides(data, ["model.num_layers=3", "model.num_layers=4", "seed=9"])
    assert out == {"model": {"num_layers": 4, "hidden_size": 64}, "seed": 9}


def test_override_without_equals_and_into_a_scalar_are_refused():
    with pytest.raises(ConfigError, match="model.num_layers"):
        cfg("model.num_layers")
    with pytest.raises(ConfigError, match="'name' is not a section"):
        apply_overrides({"name": "run"}, ["name.first=1"])
    with pytest.raises(ConfigError, match="'name' must be str"):
        cfg("name.first=1")  # not in the file: becomes a section, then a type error


@pytest.mark.parametrize(
    "override,dotted,suggestion",
    [
        ("model.hiden_size=64", "model.hiden_size", "model.hidden_size"),
        ("attention.couplng=euler", "attention.couplng", "attention.coupling"),
        ("paralel.tensor_parallel=2", "paralel", "parallel"),
        ("train.micro_batch=2", "train.micro_batch", "train.micro_batch_size"),
    ],
)
def test_unknown_key_is_refused_with_suggestion(override, dotted, suggestion):
    with pytest.raises(ConfigError) as info:
        cfg(override)
    message = str(info.value)
    assert f"unknown key '{dotted}'" in message
    assert f"did you mean '{suggestion}'" in message


def test_unknown_key_without_close_match_lists_known_keys(tmp_path):
    path = write(tmp_path / "bad.yaml", "attention:\n  zzzzzz: 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert str(path) in message and "attention.zzzzzz" in message
    assert "coupling" in message and "scoring" in message


@pytest.mark.parametrize(
    "override,dotted",
    [
        ("model.num_layers=eight", "model.num_layers"),
        ("model.num_layers=2.5", "model.num_layers"),
        ("model.num_layers=true", "model.num_layers"),  # bool is not an int here
        ("model.hidden_size=null", "model.hidden_size"),
        ("model.num_query_groups=two", "model.num_query_groups"),
        ("attention.dt_init=fast", "attention.dt_init"),
        ("attention.dt_init=true", "attention.dt_init"),
        ("parallel.sequence_parallel=1", "parallel.sequence_parallel"),
        ("attention.coupling=3", "attention.coupling"),
        ("name=[a, b]", "name"),
        ("seed=1.5", "seed"),
    ],
)
def test_wrong_type_is_refused_naming_the_field(override, dotted):
    with pytest.raises(ConfigError) as info:
        cfg(override)
    assert f"'{dotted}' must be" in str(info.value)


def test_section_that_is_not_a_mapping_is_refused(tmp_path):
    path = write(tmp_path / "bad.yaml", "model: [1, 2]\n")
    with pytest.raises(ConfigError, match="'model' must be a mapping"):
        load_config(path)
    with pytest.raises(ConfigError, match="top level"):
        load_config(write(tmp_path / "list.yaml", "- 1\n- 2\n"))


def test_save_and_load_round_trip(tmp_path):
    config = load_config(
        MODELS_DIR / "7b.yaml",
        layout_overrides(64, 8, 4)
        + [
            "attention.coupling=invertible",
            "attention.dt_init=0.125",
            "attention.coupling_hidden=32",
            "parallel.virtual_pipeline=2",
            "parallel.sequence_parallel=true",
            "train.precision=bf16",
            # (transformer_impl=transformer_engine is refused where TE is not importable, as here)
            "train.recompute=full",
            "train.recompute_method=block",
            "train.recompute_num_layers=2",
            "name=round-trip",
        ],
    )
    validate(config)
    path = tmp_path / "resolved.yaml"
    save_config(config, path)
    loaded = load_config(path)
    assert loaded == config
    assert dataclasses.asdict(loaded) == dataclasses.asdict(config)
    save_config(RunConfig(), path)
    assert load_config(path) == RunConfig()  # defaults, 1e-5 epsilon included


# ---------------------------------------------------------------------------------------
# file errors
# ---------------------------------------------------------------------------------------


def test_missing_config_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="does not exist") as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_invalid_yaml(tmp_path):
    path = write(tmp_path / "broken.yaml", "model:\n  num_layers: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML") as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_include_cycle(tmp_path):
    write(tmp_path / "a.yaml", "include: b.yaml\n")
    write(tmp_path / "b.yaml", "include: [a.yaml]\n")
    with pytest.raises(ConfigError, match="include cycle") as info:
        load_config(tmp_path / "a.yaml")
    assert "a.yaml" in str(info.value)
    with pytest.raises(ConfigError, match="include cycle"):
        load_config(write(tmp_path / "self.yaml", "include: self.yaml\n"))


def test_missing_include(tmp_path):
    path = write(tmp_path / "run.yaml", "include: [models/60m.yaml, not_there.yaml]\n")
    with pytest.raises(ConfigError, match="'not_there.yaml' not found") as info:
        load_config(path)
    assert str(tmp_path) in str(info.value)


# ---------------------------------------------------------------------------------------
# validate(): one test per rule
# ---------------------------------------------------------------------------------------


def test_valid_config_passes_and_is_returned():
    config = cfg(
        "model.num_layers=8",
        "model.num_attention_heads=8",
        "model.num_query_groups=4",
        "attention.coupling=hamiltonian",
        "attention.scoring=differential",
        "attention.steps=7",
        "parallel.tensor_parallel=2",
        "parallel.pipeline_parallel=2",
        "parallel.virtual_pipeline=2",
        "parallel.sequence_parallel=true",
        "train.micro_batch_size=2",
        "train.global_batch_size=8",
        "train.precision=bf16",
    )
    assert validate(config, world_size=8) is config
    assert validate(config) is config  # no world size: data-parallel checks skipped


@pytest.mark.parametrize(
    "override,dotted",
    [
        ("attention.coupling=leapfrog", "attention.coupling"),
        ("attention.scoring=sparse", "attention.scoring"),
        ("attention.position=post_norm", "attention.position"),
        ("model.normalization=rmsnorm", "model.normalization"),
        ("train.precision=fp16", "train.precision"),
        ("transformer_impl=apex", "transformer_impl"),
    ],
)
def test_unknown_choice(override, dotted):
    value = override.split("=", 1)[1]
    message = assert_invalid(cfg(override), f"{dotted}='{value}' is unknown")
    assert "choose one of" in message


@pytest.mark.parametrize(
    "dotted",
    [
        "model.num_layers",
        "model.hidden_size",
        "model.num_attention_heads",
        "model.seq_length",
        "model.vocab_size",
        "parallel.tensor_parallel",
        "parallel.pipeline_parallel",
        "train.micro_batch_size",
        "train.global_batch_size",
    ],
)
@pytest.mark.parametrize("value", [0, -2])
def test_non_positive_size(dotted, value):
    assert_invalid(cfg(f"{dotted}={value}"), f"{dotted}={value} must be at least 1")


def test_hidden_not_divisible_by_heads():
    message = assert_invalid(
        cfg("model.hidden_size=130", "model.num_attention_heads=4"),
        "model.hidden_size=130",
        "model.num_attention_heads=4",
    )
    assert "not divisible" in message


def test_heads_not_multiple_of_query_groups():
    assert_invalid(
        cfg("model.num_attention_heads=4", "model.num_query_groups=3"),
        "model.num_attention_heads=4 is not a multiple of model.num_query_groups=3",
    )


def test_heads_not_divisible_by_tp():
    assert_invalid(
        cfg("model.hidden_size=192", "model.num_attention_heads=6", "parallel.tensor_parallel=4"),
        "model.num_attention_heads=6 is not divisible by parallel.tensor_parallel=4",
    )


def test_query_groups_not_divisible_by_tp():
    message = assert_invalid(
        cfg(
            "model.num_attention_heads=8", "model.num_query_groups=2", "parallel.tensor_parallel=4"
        ),
        "model.num_query_groups=2 is not divisible by parallel.tensor_parallel=4",
    )
    assert "model.num_attention_heads=8 is not divisible" not in message


def test_padded_vocab_not_divisible_by_tp():
    assert_invalid(
        cfg("model.num_attention_heads=6", "model.hidden_size=192", "parallel.tensor_parallel=3"),
        "padded vocabulary 32000",
        "model.make_vocab_size_divisible_by",
    )
    # raising the padding multiple is the documented fix
    assert validate(
        cfg(
            "model.num_attention_heads=6",
            "model.hidden_size=192",
            "parallel.tensor_parallel=3",
            "model.make_vocab_size_divisible_by=384",
        )
    )


@pytest.mark.parametrize("heads,tp", [(6, 2), (3, 1)])
def test_differential_odd_heads_per_tp_rank(heads, tp):
    overrides = [
        f"model.num_attention_heads={heads}",
        f"model.hidden_size={32 * heads}",
        f"parallel.tensor_parallel={tp}",
        "model.make_vocab_size_divisible_by=384",
    ]
    config = cfg(*overrides, "attention.scoring=differential")
    assert_invalid(
        config,
        "attention.scoring=differential",
        f"holds {heads // tp} query heads",
        f"model.num_attention_heads={heads}",
        f"parallel.tensor_parallel={tp}",
    )
    assert validate(cfg(*overrides))  # fine with standard scoring


def test_differential_odd_kv_heads_per_tp_rank():
    overrides = [
        "model.num_attention_heads=8",
        "model.num_query_groups=2",
        "parallel.tensor_parallel=2",
    ]
    message = assert_invalid(
        cfg(*overrides, "attention.scoring=differential"),
        "attention.scoring=differential pairs key/value heads",
        "model.num_query_groups=2",
        "parallel.tensor_parallel=2",
    )
    assert "query heads" not in message  # 4 query heads per rank is fine
    assert validate(cfg(*overrides))


def test_layers_not_divisible_by_pp():
    message = assert_invalid(
        cfg("model.num_layers=6", "parallel.pipeline_parallel=4"),
        "model.num_layers=6",
        "parallel.pipeline_parallel=4",
    )
    assert "virtual_pipeline" not in message


def test_layers_not_divisible_by_pp_times_virtual_pipeline():
    config = cfg(
        "model.num_layers=8", "parallel.pipeline_parallel=2", "parallel.virtual_pipeline=3"
    )
    assert_invalid(
        config,
        "model.num_layers=8",
        "parallel.pipeline_parallel=2",
        "parallel.virtual_pipeline=3",
    )
    config.parallel.virtual_pipeline = 4
    assert validate(config) is config


@pytest.mark.parametrize("pp,vp", [(1, 2), (2, 0)])
def test_virtual_pipeline_without_pipeline(pp, vp):
    config = cfg(
        "model.num_layers=4", f"parallel.pipeline_parallel={pp}", f"parallel.virtual_pipeline={vp}"
    )
    assert_invalid(config, "parallel.virtual_pipeline", "parallel.pipeline_parallel > 1")


def test_sequence_parallel_without_tp():
    config = cfg("parallel.sequence_parallel=true")
    assert_invalid(config, "parallel.sequence_parallel", "parallel.tensor_parallel > 1")
    config.parallel.tensor_parallel = 2
    assert validate(config) is config


@pytest.mark.parametrize("steps", [0, 8, -1])
def test_steps_out_of_range(steps):
    assert_invalid(cfg(f"attention.steps={steps}"), f"attention.steps={steps}", "1 to 7")


@pytest.mark.parametrize("steps", [1, 7])
def test_steps_at_the_bounds_pass(steps):
    assert validate(cfg(f"attention.steps={steps}", "attention.coupling=euler"))


@pytest.mark.parametrize("dt", [0, -0.1])
def test_dt_init_not_positive(dt):
    assert_invalid(cfg(f"attention.dt_init={dt}"), f"attention.dt_init={float(dt)}", "positive")


def test_mlp_only_needs_coupling_hidden_of_two():
    config = cfg("attention.coupling=mlp_only", "attention.coupling_hidden=1")
    assert_invalid(config, "attention.coupling_hidden=1", "mlp_only", "at least 2")
    assert validate(cfg("attention.coupling=hamiltonian", "attention.coupling_hidden=1"))
    assert validate(cfg("attention.coupling=mlp_only", "attention.coupling_hidden=2"))
    assert_invalid(cfg("attention.coupling_hidden=0"), "attention.coupling_hidden=0")


def test_invertible_layers_zero():
    assert_invalid(
        cfg("attention.coupling=invertible", "attention.invertible_layers=0"),
        "attention.invertible_layers",
    )


def test_invertible_scale_bound_not_positive():
    assert_invalid(cfg("attention.invertible_scale_bound=0"), "attention.invertible_scale_bound")


def test_world_size_not_divisible_by_tp_times_pp():
    config = cfg("parallel.tensor_parallel=2", "parallel.pipeline_parallel=2")
    message = assert_invalid(
        config,
        "world size 6",
        "parallel.tensor_parallel=2",
        "parallel.pipeline_parallel=2",
        world_size=6,
    )
    assert "multiple of 4" in message
    assert validate(config, world_size=8) is config
    # parallel.world_size is used when no world size is passed, and the argument wins
    config.parallel.world_size = 6
    assert_invalid(config, "world size 6")
    assert validate(config, world_size=4) is config


def test_global_batch_not_divisible_by_micro_times_dp():
    config = cfg("train.micro_batch_size=2", "train.global_batch_size=8")
    message = assert_invalid(
        config,
        "train.global_batch_size=8",
        "train.micro_batch_size=2",
        "data parallel 8",
        world_size=8,
    )
    assert "multiple of 16" in message
    assert validate(config, world_size=4) is config
    assert validate(config) is config  # unknown world size: not checked


@pytest.mark.parametrize(
    "override",
    ["model.hidden_dropout=1.0", "model.attention_dropout=-0.1", "model.attention_dropout=1.5"],
)
def test_dropout_out_of_range(override):
    assert_invalid(cfg(override), "model.hidden_dropout", "model.attention_dropout", "[0, 1)")
    assert validate(cfg("model.hidden_dropout=0.1", "model.attention_dropout=0.0"))


def test_all_errors_are_reported_together():
    message = assert_invalid(
        cfg("attention.steps=9", "attention.dt_init=0", "parallel.sequence_parallel=true"),
        "attention.steps",
        "attention.dt_init",
        "parallel.sequence_parallel",
    )
    assert message.count("\n  - ") == 3


def test_errors_of_every_section_are_listed_together():
    # one wrong field in each section of the field checks: all named, none hidden
    message = assert_invalid(
        cfg(
            "log.wandb_mode=loud",  # names
            "model.family=llama",  # architecture: a field contradicts the family
            "model.normalization=LayerNorm",
            "train.optimizer.lr=-1",  # training
            "data.split=90,10",  # data
            "model.num_layers=0",  # sizes
        ),
        "log.wandb_mode='loud'",
        "model.normalization='LayerNorm' contradicts model.family='llama'",
        "train.optimizer.lr must be positive",
        "data.split='90,10'",
        "model.num_layers=0",
    )
    assert message.count("\n  - ") == 5
    # and in each section of the combination checks, with stated hardware facts
    errors = config_errors(
        cfg(
            "model.num_attention_heads=3",  # model shape
            "train.engine=megatron",
            "train.precision=fp64",  # engine
            "train.overlap_grad_reduce=true",  # hardware (with PP on a machine without CUDA)
            "parallel.pipeline_parallel=2",
            "model.num_layers=3",  # layout
            "attention.steps=9",  # attention options
            "train.recompute_num_layers=2",  # recompute
        ),
        world_size=3,  # world: not a multiple of TP x PP = 2
        hardware=StatedHardware(cuda=False),
    )
    for text in [
        "model.hidden_size=128 is not divisible by model.num_attention_heads=3",
        "train.precision='fp64' with train.engine=megatron",
        "hangs on CPU",
        "model.num_layers=3 is not divisible by parallel.pipeline_parallel=2",
        "attention.steps=9",
        "train.recompute_num_layers=2 applies to train.recompute=full only",
        "world size 3 is not divisible",
    ]:
        assert sum(text in error for error in errors) == 1, (text, errors)
    assert len(errors) == 7, errors


def test_hardware_checks_take_the_machine_as_stated_facts():
    # overlapping gradient reduction with pipeline parallelism needs CUDA (gloo hangs)
    overlap = cfg(
        "train.engine=megatron", "train.overlap_grad_reduce=true", "parallel.pipeline_parallel=2"
    )
    no_gpu, gpu = StatedHardware(cuda=False), StatedHardware(cuda=True)
    (refusal,) = hardware_errors(overlap, no_gpu)
    assert "train.overlap_grad_reduce=true with parallel.pipeline_parallel=2" in refusal
    assert hardware_errors(overlap, gpu) == []
    assert config_errors(overlap, 2, gpu) == []
    assert config_errors(overlap, 2, no_gpu) == [refusal]
    # the Transformer Engine backend needs it importable, whatever the GPU
    te = cfg("transformer_impl=transformer_engine")
    (refusal,) = hardware_errors(te, gpu)
    assert "Transformer Engine is not importable" in refusal
    assert hardware_errors(te, StatedHardware(cuda=True, transformer_engine=True)) == []
    assert hardware_errors(cfg(), no_gpu) == []  # the default config needs neither


def test_validate_reads_the_machine_only_where_a_check_needs_it(monkeypatch):
    import cqk_megatron.config.checks as config_module

    def unread():
        raise AssertionError("the machine was read for a config that does not depend on it")

    monkeypatch.setattr(config_module, "_cuda_available", unread)
    monkeypatch.setattr(config_module, "_transformer_engine_importable", unread)
    validate(cfg("parallel.pipeline_parallel=2", "train.engine=megatron"), 2)
    with pytest.raises(AssertionError, match="was read"):
        validate(cfg("transformer_impl=transformer_engine"))


def test_variant_property_names_non_preset_pairs():
    assert AttentionConfig(coupling="euler", scoring="differential").variant == (
        "euler+differential"
    )


# ---------------------------------------------------------------------------------------
# regressions: bugs found in review, fixed
# ---------------------------------------------------------------------------------------


def test_float_without_dot_in_exponent():
    assert cfg("attention.dt_init=1e-3").attention.dt_init == 1e-3


def test_empty_section_does_not_wipe_include(tmp_path):
    run = write(tmp_path / "run.yaml", "include: [models/60m.yaml]\nmodel:\n")
    assert load_config(run).model.num_layers == 8


def test_zero_query_groups_refused():
    assert_invalid(cfg("model.num_query_groups=0"), "model.num_query_groups")


@pytest.mark.parametrize(
    "override", ["model.make_vocab_size_divisible_by=0", "parallel.world_size=0"]
)
def test_zero_divisors_refused(override):
    assert_invalid(cfg(override), override.split("=")[0])


def test_negative_ffn_refused():
    assert_invalid(cfg("model.ffn_hidden_size=-5"), "model.ffn_hidden_size")


def test_overrides_do_not_mutate_input():
    data = {"model": {"num_layers": 2}}
    apply_overrides(data, ["model.num_layers=3"])
    assert data == {"model": {"num_layers": 2}}


def test_data_loader_workers_are_refused_not_ignored():
    # nothing reads them: each rank fetches its own micro-batches (training/sampler.py)
    message = assert_invalid(cfg("data.num_workers=2"), "data.num_workers=2")
    assert "set data.num_workers=0 or remove it" in message
    validate(cfg("data.num_workers=0"))


@pytest.mark.parametrize(
    ("overrides", "named", "fix"),
    [
        (
            ["parallel.pipeline_parallel=2", "train.zero_stage=2"],
            "train.zero_stage=2 with parallel.pipeline_parallel=2",
            "use train.zero_stage=1 with pipeline parallelism",
        ),
        (
            ["parallel.pipeline_parallel=2", "train.zero_stage=3"],
            "train.zero_stage=3 with parallel.pipeline_parallel=2",
            "use train.zero_stage=1 with pipeline parallelism",
        ),
        (
            ["train.engine=megatron", "train.offload_optimizer=true"],
            "train.offload_optimizer=true is DeepSpeed's optimizer offload",
            "train.engine=megatron",
        ),
        (
            [
                "parallel.pipeline_parallel=2",
                "model.tie_embeddings=true",
                "train.offload_optimizer=true",
            ],
            "train.offload_optimizer=true with model.tie_embeddings=true and "
            "parallel.pipeline_parallel=2",
            "set model.tie_embeddings=false, or train.offload_optimizer=false",
        ),
    ],
    ids=["zero2-pp2", "zero3-pp2", "megatron-offload", "offload-tied-pp2"],
)
def test_engine_and_layout_combinations_that_cannot_train_right_are_refused(overrides, named, fix):
    # ZeRO-2/3 reduce inside each backward, which Megatron's pipeline schedule drives; the
    # Megatron engine has no optimizer offload; DeepSpeed's offload reduces in hooks before
    # the tied copies are summed (it crashed at step 1: tests/test_cluster_matrix.py)
    message = assert_invalid(cfg(*overrides), named)
    assert fix in message, message


def test_replica_check_interval_is_an_option_off_by_default():
    assert_invalid(
        cfg("train.resilience.check_replicas_interval=-1"),
        "train.resilience.check_replicas_interval=-1",
    )
    assert cfg().train.resilience.check_replicas_interval == 0
    validate(cfg("train.resilience.check_replicas_interval=100"))


def test_the_old_name_of_transformer_impl_is_read_with_a_warning(tmp_path):
    # "backend" was renamed "transformer_impl" (the launcher's --cluster local is the other
    # "local"); configs, checkpoints and wandb runs written before still load, and warn.
    old_file = write(tmp_path / "old.yaml", "backend: transformer_engine\n")
    with pytest.warns(FutureWarning, match="'backend' is now 'transformer_impl'"):
        assert load_config(old_file).transformer_impl == "transformer_engine"
    with pytest.warns(FutureWarning, match="'backend' is now 'transformer_impl'"):
        assert cfg("backend=transformer_engine").transformer_impl == "transformer_engine"
    saved = to_dict(cfg())
    saved["backend"] = saved.pop("transformer_impl")
    with pytest.warns(FutureWarning):
        assert from_dict(RunConfig, saved, "iter_0000005/config.yaml") == cfg()
    # an old name in a file loses to an override of the new one, and the reverse
    new_over_old = load_config(old_file, ["transformer_impl=local"])
    assert new_over_old.transformer_impl == "local"
    new_file = write(tmp_path / "new.yaml", "include: [old.yaml]\ntransformer_impl: local\n")
    assert load_config(new_file).transformer_impl == "local"
    assert load_config(new_file, ["backend=transformer_engine"]).transformer_impl == (
        "transformer_engine"
    )
    # both names in one mapping must agree
    both = write(tmp_path / "both.yaml", "backend: transformer_engine\ntransformer_impl: local\n")
    with pytest.raises(ConfigError, match=r"both.yaml: 'backend' .*keep only 'transformer_impl'"):
        load_config(both)
    assert "backend" not in to_dict(cfg())  # and only the new name is written


# train's keys moved into a section: {section: [(old key, new key, a value not the default)]}
MOVED_TRAIN_KEYS = {
    "checkpoint": [
        ("save_interval", "checkpoint.save_interval", 7),
        ("keep_last", "checkpoint.keep_last", 5),
        ("checkpoint_hashes", "checkpoint.hashes", False),
        ("async_save", "checkpoint.async_save", True),
    ],
    "optimizer": [
        ("lr", "optimizer.lr", 0.002),
        ("weight_decay", "optimizer.weight_decay", 0.05),
        ("adam_beta1", "optimizer.beta1", 0.8),
        ("adam_beta2", "optimizer.beta2", 0.99),
        ("adam_eps", "optimizer.eps", 1e-6),
        ("clip_grad", "optimizer.clip_grad", 0.5),
    ],
    "schedule": [
        ("lr_schedule", "schedule.decay", "wsd"),
        ("warmup_steps", "schedule.warmup_steps", 3),
        ("min_lr", "schedule.min_lr", 1e-5),
        ("wsd_decay_fraction", "schedule.wsd_decay_fraction", 0.5),
    ],
    "resilience": [
        ("max_nan_steps", "resilience.max_nan_steps", 2),
        ("wall_clock_budget_s", "resilience.wall_clock_budget_s", 600.0),
        ("exit_after_steps", "resilience.exit_after_steps", 3),
        ("check_replicas_interval", "resilience.check_replicas_interval", 4),
        ("init_timeout_s", "resilience.init_timeout_s", 400.0),
        ("collective_timeout_s", "resilience.collective_timeout_s", 120.0),
        ("step_timeout_s", "resilience.step_timeout_s", 50.0),
        ("save_timeout_s", "resilience.save_timeout_s", 700.0),
        ("heartbeat_interval_s", "resilience.heartbeat_interval_s", 2.0),
        ("heartbeat_timeout_s", "resilience.heartbeat_timeout_s", 20.0),
    ],
}


def train_value(config: RunConfig, dotted: str):
    node = config.train
    for key in dotted.split("."):
        node = getattr(node, key)
    return node


def moved_warning(old: str, new: str) -> str:
    return re.escape(f"'train.{old}' is now 'train.{new}'; the old name is read")


@pytest.mark.parametrize("section", list(MOVED_TRAIN_KEYS))
def test_the_keys_moved_into_a_train_section_are_read_with_a_warning(section, tmp_path):
    # configs, checkpoints and wandb runs written before the move still load, and warn
    moved = MOVED_TRAIN_KEYS[section]
    old_text = "train:\n" + "".join(f"  {old}: {value}\n" for old, _, value in moved)
    old_file = write(
        tmp_path / "old.yaml", old_text.replace("True", "true").replace("False", "false")
    )
    with pytest.warns(FutureWarning) as said:
        loaded = load_config(old_file)
    for old, new, value in moved:  # each old key lands in its new place, and says so
        assert train_value(loaded, new) == value, new
        assert any(re.search(moved_warning(old, new), str(w.message)) for w in said), old
        with pytest.warns(FutureWarning, match=moved_warning(old, new)):
            assert train_value(cfg(f"train.{old}={value}"), new) == value
    saved = to_dict(loaded)  # the config an older checkpoint holds: the old keys, flat
    for old, new, _ in moved:
        saved["train"][old] = saved["train"][section].pop(new.split(".", 1)[1])
    with pytest.warns(FutureWarning, match=moved_warning(*moved[0][:2])):
        assert from_dict(RunConfig, saved, "iter_0000005/config.yaml") == loaded
    assert not set(to_dict(loaded)["train"]) & {old for old, _, _ in moved}  # written new
    # an old name in a file loses to an override of the new one, and the reverse
    old, new, value = moved[0]
    default = train_value(cfg(), new)
    assert train_value(load_config(old_file, [f"train.{new}={default}"]), new) == default
    inner = new.split(".", 1)[1]
    new_file = write(
        tmp_path / "new.yaml",
        f"include: [old.yaml]\ntrain:\n  {section}:\n    {inner}: {default}\n",
    )
    assert train_value(load_config(new_file), new) == default
    with pytest.warns(FutureWarning):
        assert train_value(load_config(new_file, [f"train.{old}={value}"]), new) == value
    # both names in one mapping must agree
    both = write(
        tmp_path / "both.yaml", f"train:\n  {old}: {value}\n  {section}:\n    {inner}: {default}\n"
    )
    with pytest.raises(ConfigError, match=rf"'train.{old}' .*keep only 'train.{new}'"):
        load_config(both)
